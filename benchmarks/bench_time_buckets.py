"""Time-planned vs size-capped vs no gradient buckets, and Lightning ``ddp``, on an emulated 2-node link.

Needs root and iproute2; what it sets up and measures: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from functools import partial

from harness import cli, jobs, report
from harness.cluster import EmulatedCluster, StrategyRun, run_on_cluster, run_workers
from harness.jobs import BUSY_HOST_CORES

WORKER = jobs.BENCH_DIR / "_hier_sliced_worker.py"
NAME_PREFIX, SUBNET_PREFIX = "lhtb", "10.78.0"  # not "lhbench": leaves a bench_hier_sliced.py cluster alone
BASE_PORT, LR = 29640, 1e-4
LABELS = {"none": "hier none", "size": "hier size", "time": "hier time", "ddp": "ddp"}
TARGETS = {"none": 0.85, "ddp": 1.0}  # hier time's step time <= target x the reference's
NOTE = "  other processes used {:.2f} cores while measuring; retrying"
OPTIONS = """
--rate-mbit            float  500                 egress limit per node (Mbit/s)
--hidden               int    1024                MLP width
--layers               int    12                  number of Linear(hidden, hidden) layers
--batch-size           int    1280                per-process batch size
--warmup               int    3                   warm-up steps (for time: after profiling)
--steps                int    8                   measured steps
--profile-steps        int    3                   bucketing='time': profiled steps
--profile-warmup-steps int    1                   bucketing='time': steps before profiling
--min-bucket-mb        float  1.0                 bucketing='time': smallest bucket
--bucket-cap-mb        float  25.0                hier_sliced bucket cap (MB; ddp: Lightning's defaults)
--strategies           str    none,size,time,ddp  comma-separated: none,size,time,ddp
"""


class Run(StrategyRun):
    """A strategy's run, with the host's load while measuring."""

    @property
    def quiet_step_s(self) -> float:
        """Mean time of the steps during which other processes left the CPU alone (nan when none did)."""
        quiet = self.worker["quiet_step_times_s"]
        return sum(quiet) / len(quiet) if quiet else float("nan")

    @property
    def other_cores(self) -> float:
        """Cores that other processes used, averaged over the measured window."""
        return float(self.worker.get("other_cpu_cores", 0.0))


def run_strategy(cluster: EmulatedCluster, args: argparse.Namespace, i: int, strategy: str, n: int) -> Run:
    """``ddp`` or ``hier_sliced`` with bucketing ``strategy``, one worker a node; attempt ``n`` (from 1) at
    the ``i``-th strategy, on a port of its own."""
    hier = {"bucketing": strategy, "bucket_cap_mb": args.bucket_cap_mb}
    warmup = args.warmup
    if strategy == "time":  # measured after its profiling
        hier["bucketing"] = {  # a TimeBuckets' fields
            "profile_steps": args.profile_steps,
            "warmup_steps": args.profile_warmup_steps,
            "min_bucket_mb": args.min_bucket_mb,
        }
        warmup += args.profile_warmup_steps + args.profile_steps
    name, options = ("ddp", {}) if strategy == "ddp" else ("hier_sliced", hier)  # ddp: Lightning's defaults
    config = {"strategy": name, "strategy_options": options, "record": "buckets", "lr": LR, "warmup": warmup}
    config.update(jobs.pick(args, "hidden", "layers", "batch_size", "steps"))
    argv = [sys.executable, str(WORKER), "--config", json.dumps(config)]
    port = BASE_PORT + 10 * (n - 1) + i
    try:
        return Run(strategy, worker=run_workers(cluster, argv, f"{NAME_PREFIX}-{strategy}", 1, port, args))
    except Exception as exc:  # report it and go on with the next strategy
        return Run(strategy, ok=False, error=str(exc))


def verdict(value: float, target: float) -> str:
    """Whether ``value`` is within ``target`` (n/a for nan)."""
    return "n/a" if value != value else ("MET" if value <= target else "NOT MET")


def table_row(r: Run, done: dict[str, Run]) -> str:
    """One strategy's line of the table."""
    if not r.ok:
        return f"{LABELS[r.strategy]:<10} FAILED (see below)"
    w = r.worker
    vs_none, vs_ddp = (f"{r.step_s / done[k].step_s:.3f}" if k in done else "n/a" for k in ("none", "ddp"))
    quiet = f"{r.quiet_step_s:.3f} ({len(w['quiet_step_times_s'])}/{len(w['step_times_s'])})"
    return (
        f"{LABELS[r.strategy]:<10} {r.step_s:>9.3f} {vs_none:>8} {vs_ddp:>7} "
        f"{w['mean_hidden_fraction']:>7.1%} {w['mean_backward_s']:>13.3f} {w['mean_comm_union_s']:>9.3f} "
        f"{w['mean_exposed_s']:>12.3f} {w['num_buckets']:>8} {w['median_step_s']:>11.3f} "
        f"{r.other_cores:>10.2f} {quiet:>16}"
    )


def balance(done: dict[str, Run], rate_mbit: float) -> str:
    """Backward vs communication time of ``none``: comparing only means something when they are close."""
    if "none" not in done:
        return "balance: bucketing='none' not run (its communication time is the reference)"
    w = done["none"].worker
    backward, comm, mb = w["mean_backward_s"], w["mean_comm_union_s"], w["grad_bytes"] / 1e6
    return (
        f"balance: backward {backward:.3f} s vs communication of all gradients after backward "
        f"(bucketing='none') {comm:.3f} s -> comm/backward = {comm / backward:.2f} "
        f"({mb:.1f} MB all-reduced at {mb * 8 / comm:.0f} Mbit/s of a {rate_mbit:g} Mbit/s link)"
    )


def targets(done: dict[str, Run]) -> list[str]:
    """The targets for ``time`` and whether they are met (on a busy host also on quiet steps only)."""
    lines = ["targets: " + "; ".join(f"hier time step <= {t} x {LABELS[k]}" for k, t in TARGETS.items())]
    for name, target in TARGETS.items():
        contender, ref = done.get("time"), done.get(name)
        ratio = contender.step_s / ref.step_s if contender and ref else float("nan")
        lines.append(f"  vs {name}: {ratio:.3f} -> {verdict(ratio, target)}")
        if contender and ref and max(contender.other_cores, ref.other_cores) > BUSY_HOST_CORES:
            quiet = contender.quiet_step_s / ref.quiet_step_s
            lines[-1] += f"   (host busy; on quiet steps only: {quiet:.3f} -> {verdict(quiet, target)})"
    return lines


def timelines(done: dict[str, Run]) -> list[str]:
    """The time plan, and every strategy's buckets in its last measured step (ms after backward start)."""
    lines = []
    if "time" in done:
        w = done["time"].worker
        profiled = w["plan"]["backward_seconds"] * 1e3
        lines.append(f"time plan: {w['plan']['describe']}; profiled backward {profiled:.0f} ms")
        if w["plans_made_at_end"] != w["plans_made_at_start"]:
            plans = f"{w['plans_made_at_start']} -> {w['plans_made_at_end']} plans"
            lines.append(f"  WARNING: re-planned during the measured window ({plans})")
    for r in done.values():
        last = r.worker["steps"][-1]
        spans = zip(last["bucket_bytes"], last["bucket_launch_s"], last["bucket_done_s"])
        buckets = ", ".join(f"{b / 2**20:.1f}MB {s * 1e3:.0f}-{d * 1e3:.0f}" for b, s, d in spans)
        head = f"{LABELS[r.strategy]:<10} last step: backward ends {last['backward_s'] * 1e3:.0f} ms"
        lines.append(f"{head}; buckets (size launch-done ms): {buckets}")
    return lines


def print_report(args: argparse.Namespace, cluster: EmulatedCluster, results: list[Run]) -> None:
    """The set-up, the table, the balance, the targets, the timelines and the errors; the JSON file."""
    done = {r.strategy: r for r in results if r.ok}
    header = (
        f"{'strategy':<10} {'step [s]':>9} {'vs none':>8} {'vs ddp':>7} {'hidden':>7} "
        f"{'backward [s]':>13} {'comm [s]':>9} {'exposed [s]':>12} {'buckets':>8} {'median [s]':>11} "
        f"{'other CPU':>10} {'quiet steps [s]':>16}"
    )
    print(
        f"\n{cluster.describe(1)}\nMLP {args.layers} x Linear({args.hidden}, {args.hidden}), batch "
        f"{args.batch_size}/process, warmup {args.warmup} (+{args.profile_warmup_steps}+{args.profile_steps} "
        f"profiling for time), measured steps {args.steps}"
    )
    print(report.text_table(header, [table_row(r, done) for r in results]))
    print("\n".join(["", balance(done, args.rate_mbit), *targets(done), "", *timelines(done)]))
    report.print_failures([(f"[{LABELS[r.strategy]}]", r.error) for r in results if not r.ok])
    payload = {"config": report.config(args), "targets": {f"time_vs_{k}": t for k, t in TARGETS.items()}}
    payload["cluster"] = {"burst_bytes": cluster.burst_bytes, "latency_ms": cluster.latency_ms}
    report.save_json(args.json_out, lambda: {**payload, "results": [asdict(r) for r in results]})


def main(argv: list[str] | None = None) -> int:
    """Run the requested strategies on one emulated cluster and report; returns the exit code."""
    run_options = cli.RUN_OPTIONS.format(timeout=300, per="strategy run", logs="the per-run temp dir")
    p = cli.parser(__doc__, OPTIONS, run_options, cli.IDLE_OPTIONS.format(job="strategy"))
    args = p.parse_args(argv)
    args.strategies = cli.comma_list(args.strategies)
    if not set(args.strategies) <= set(LABELS):
        p.error(f"--strategies: choose from {', '.join(LABELS)}")

    def run_all(cluster: EmulatedCluster) -> bool:
        results = []
        for i, strategy in enumerate(args.strategies):  # after --wait-idle; again while the host was busy
            run = partial(run_strategy, cluster, args, i, strategy)
            results.append(jobs.run_until_quiet(run, args.retry_busy, args.wait_idle, NOTE, keep_best=False))
        print_report(args, cluster, results)
        return all(r.ok for r in results)

    options = {"num_nodes": 2, "rate_mbit": args.rate_mbit, "subnet_prefix": SUBNET_PREFIX}
    return run_on_cluster(run_all, name_prefix=NAME_PREFIX, **options)


if __name__ == "__main__":
    sys.exit(main())
