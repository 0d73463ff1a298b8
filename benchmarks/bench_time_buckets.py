"""Time-planned vs size-capped vs no gradient buckets, and Lightning ``ddp``, on an emulated 2-node link.

Two network namespaces act as nodes, joined by a bridge; each node's egress is shaped to
``--rate-mbit`` (see ``harness/cluster.py``). For every strategy one worker process
(``_time_buckets_worker.py``) runs per node (world size 2, ``devices=1, num_nodes=2``), so the two
ranks' compute does not fight for the 2 cores of a small host, and ``HierSlicedStrategy
(devices_per_node=1)`` is a plain inter-node all-reduce per bucket. The model is an MLP whose
backward takes about as long as sending its gradients at the chosen rate, so how much
communication hides behind backward decides the step time.

Compared: ``hier_sliced`` with ``bucketing="time"`` (measured after its warm-up and profiling
steps, with a plan in place), ``"size"`` (default 25 MiB cap), ``"none"`` (everything after
backward) and Lightning's ``ddp``. Reported per strategy: mean step time (rank 0, start to start),
ratios to ``none`` and ``ddp``, the hidden-communication fraction, backward time, communication
time and the exposed communication after backward.

Needs root and iproute2::

    sudo python benchmarks/bench_time_buckets.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness import cli, jobs, report
from harness.cluster import EmulatedCluster, launch, logs_tail, run_on_cluster, watch
from harness.jobs import BUSY_HOST_CORES

WORKER = jobs.BENCH_DIR / "_time_buckets_worker.py"
NUM_NODES = 2
BASE_PORT = 29640
NAME_PREFIX = "lhtb"  # not "lhbench": must not tear down a concurrent bench_hier_sliced.py cluster
SUBNET_PREFIX = "10.78.0"
STRATEGIES = ("none", "size", "time", "ddp")
LABELS = {"none": "hier none", "size": "hier size", "time": "hier time", "ddp": "ddp"}
TARGET_VS_NONE = 0.85
TARGET_VS_DDP = 1.0
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
--bucket-cap-mb        float  None                hier_sliced bucket cap (default: the strategy's)
--strategies           str    none,size,time,ddp  comma-separated: none,size,time,ddp
"""
WORKER_OPTIONS = (
    "hidden",
    "layers",
    "batch_size",
    "warmup",
    "steps",
    "profile_steps",
    "profile_warmup_steps",
    "min_bucket_mb",
)


@dataclass
class RunResult:
    """Outcome of one strategy run (``worker`` is rank 0's JSON)."""

    strategy: str
    ok: bool
    error: str = ""
    wall_s: float = 0.0
    other_cpu_cores_run: float = 0.0  # whole run, start-up included
    worker: dict[str, Any] = field(default_factory=dict)

    @property
    def step_s(self) -> float:
        """Mean step time over all measured steps."""
        return float(self.worker["mean_step_s"])

    @property
    def quiet_steps(self) -> list[float]:
        """Step times of the measured steps during which other processes left the CPU alone."""
        other = self.worker.get("other_cpu_cores_per_step") or []
        return [t for t, o in zip(self.worker["step_times_s"], other) if o <= BUSY_HOST_CORES]

    @property
    def quiet_step_s(self) -> float:
        """Mean step time over the quiet steps (nan when there is none)."""
        quiet = self.quiet_steps
        return sum(quiet) / len(quiet) if quiet else float("nan")

    @property
    def other_cores(self) -> float:
        """Cores used by other processes, averaged over the measured window."""
        other = self.worker.get("other_cpu_cores_per_step") or []
        steps = self.worker.get("step_times_s") or []
        total = sum(steps[: len(other)])
        return sum(o * t for o, t in zip(other, steps)) / total if total > 0 else 0.0

    @property
    def disturbed(self) -> bool:
        """Whether other processes took a noticeable share of the CPU during the measured window."""
        return self.other_cores > BUSY_HOST_CORES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of the driver."""
    run_options = cli.RUN_OPTIONS.format(timeout=300, per="strategy run", logs="the per-run temp dir")
    p = cli.parser(__doc__, OPTIONS, run_options, cli.IDLE_OPTIONS.format(job="strategy"))
    args = p.parse_args(argv)
    args.strategies = cli.comma_list(args.strategies)
    unknown = set(args.strategies) - set(STRATEGIES)
    if unknown:
        p.error(f"unknown strategies: {sorted(unknown)}")
    return args


def worker_argv(args: argparse.Namespace, strategy: str, workdir: Path) -> list[str]:
    """Command line of one worker."""
    options = jobs.pick(args, *WORKER_OPTIONS)
    tail = jobs.flags(out=workdir / "rank0.json", pid_dir=workdir, bucket_cap_mb=args.bucket_cap_mb)
    return [sys.executable, str(WORKER), *jobs.flags(strategy=strategy, **options), *tail]


def run_strategy(cluster: EmulatedCluster, args: argparse.Namespace, strategy: str, port: int) -> RunResult:
    """Run one strategy (one worker per node) and collect rank 0's timings."""
    with jobs.job_dir(f"{NAME_PREFIX}-{strategy}-", args.keep_logs, stop=cluster.kill_processes) as workdir:
        print(f"[{LABELS[strategy]}] running {NUM_NODES} workers (logs: {workdir}) ...", flush=True)
        t0 = time.monotonic()
        before = jobs.cpu_snapshot()
        try:
            argv = worker_argv(args, strategy, workdir)
            procs = launch(cluster, argv, workdir, 1, port, f"{NAME_PREFIX}-{strategy}-{os.getpid()}")
            watch(procs, args.timeout, 0.05, started=t0)
            other = jobs.other_cores(before, jobs.cpu_snapshot())
            worker = json.loads((workdir / "rank0.json").read_text())
            return RunResult(
                strategy, True, wall_s=time.monotonic() - t0, other_cpu_cores_run=other, worker=worker
            )
        except Exception as exc:  # report and continue with the next strategy
            return RunResult(
                strategy, ok=False, error=f"{exc}\n{logs_tail(workdir)}", wall_s=time.monotonic() - t0
            )


def run_when_quiet(cluster: EmulatedCluster, args: argparse.Namespace, i: int, strategy: str) -> RunResult:
    """``run_strategy`` after ``--wait-idle``; again, up to ``--retry-busy`` times, while others used the
    CPU (the last run counts); every attempt on a port of its own."""

    attempt = lambda n: run_strategy(cluster, args, strategy, BASE_PORT + 10 * (n - 1) + i)
    note = "  other processes used {:.2f} cores while measuring; retrying"
    return jobs.run_until_quiet(attempt, args.retry_busy, args.wait_idle, note, keep_best=False)


def _find(results: list[RunResult], strategy: str) -> RunResult | None:
    return next((r for r in results if r.ok and r.strategy == strategy), None)


def format_table(results: list[RunResult]) -> str:
    """Human-readable comparison table."""
    none, ddp = _find(results, "none"), _find(results, "ddp")
    header = (
        f"{'strategy':<10} {'step [s]':>9} {'vs none':>8} {'vs ddp':>7} {'hidden':>7} "
        f"{'backward [s]':>13} {'comm [s]':>9} {'exposed [s]':>12} {'buckets':>8} {'median [s]':>11} "
        f"{'other CPU':>10} {'quiet steps [s]':>16}"
    )
    rows = []
    for r in results:
        if not r.ok:
            rows.append(f"{LABELS[r.strategy]:<10} FAILED (see below)")
            continue
        w = r.worker
        vs_none = f"{r.step_s / none.step_s:.3f}" if none else "n/a"
        vs_ddp = f"{r.step_s / ddp.step_s:.3f}" if ddp else "n/a"
        quiet = f"{r.quiet_step_s:.3f} ({len(r.quiet_steps)}/{len(w['step_times_s'])})"
        rows.append(
            f"{LABELS[r.strategy]:<10} {r.step_s:>9.3f} {vs_none:>8} {vs_ddp:>7} "
            f"{w['mean_hidden_fraction']:>7.1%} {w['mean_backward_s']:>13.3f} {w['mean_comm_union_s']:>9.3f} "
            f"{w['mean_exposed_s']:>12.3f} {w['num_buckets']:>8} {w['median_step_s']:>11.3f} "
            f"{r.other_cores:>10.2f} {quiet:>16}"
        )
    busy = [LABELS[r.strategy] for r in results if r.ok and r.disturbed]
    if busy:
        rows.append(
            f"WARNING: other processes used > {BUSY_HOST_CORES} cores while measuring {busy}: "
            "their step times are inflated; rerun on a quiet host (or see 'quiet steps')"
        )
    return report.text_table(header, rows)


def format_balance(results: list[RunResult], rate_mbit: float) -> str:
    """Backward compute vs communication: the comparison is only meaningful when they are close."""
    none = _find(results, "none")
    if none is None:
        return "balance: bucketing='none' not run (its communication time is the reference)"
    w = none.worker
    backward = w["mean_backward_s"]
    comm = w["mean_comm_union_s"]
    mbit = w["grad_bytes"] * 8 / comm / 1e6 if comm > 0 else float("nan")
    return (
        f"balance: backward {backward:.3f} s vs communication of all gradients after backward "
        f"(bucketing='none') {comm:.3f} s -> comm/backward = {comm / backward:.2f} "
        f"({w['grad_bytes'] / 1e6:.1f} MB all-reduced at {mbit:.0f} Mbit/s of a {rate_mbit:g} Mbit/s link)"
    )


def format_targets(results: list[RunResult]) -> str:
    """Targets for bucketing='time' and whether they are met."""
    time_r, none, ddp = _find(results, "time"), _find(results, "none"), _find(results, "ddp")
    lines = [
        f"targets: hier time step <= {TARGET_VS_NONE} x hier none; hier time step <= {TARGET_VS_DDP} x ddp"
    ]
    if time_r is None:
        lines.append("  bucketing='time' not run or failed -> targets not evaluated")
        return "\n".join(lines)
    for name, ref, target in (("none", none, TARGET_VS_NONE), ("ddp", ddp, TARGET_VS_DDP)):
        if ref is None:
            lines.append(f"  vs {name}: not run -> not evaluated")
            continue
        ratio = time_r.step_s / ref.step_s
        line = f"  vs {name}: {ratio:.3f} -> {'MET' if ratio <= target else 'NOT MET'}"
        if time_r.disturbed or ref.disturbed:
            quiet = time_r.quiet_step_s / ref.quiet_step_s
            verdict = "MET" if quiet <= target else ("NOT MET" if quiet == quiet else "n/a")
            line += f"   (host busy; on quiet steps only: {quiet:.3f} -> {verdict})"
        lines.append(line)
    return "\n".join(lines)


def format_details(results: list[RunResult]) -> str:
    """The time plan and the last measured step's bucket spans of every strategy (ms after backward start)."""
    lines = []
    time_r = _find(results, "time")
    if time_r is not None:
        w = time_r.worker
        plan = w.get("plan") or {}
        lines.append(f"time plan: {plan.get('describe')}")
        if plan.get("backward_seconds") is not None:
            lines.append(
                f"  profiled backward {plan['backward_seconds'] * 1e3:.0f} ms vs measured "
                f"{w['mean_backward_s'] * 1e3:.0f} ms (buckets go out when their gradients are ready, not at "
                "these time points; a large difference only matters for the drift check)"
            )
        if w.get("plans_made_at_end") != w.get("plans_made_at_start"):
            lines.append(
                f"  WARNING: re-planned during the measured window "
                f"({w.get('plans_made_at_start')} -> {w.get('plans_made_at_end')} plans)"
            )
    for r in results:
        if not r.ok:
            continue
        last = r.worker["steps"][-1]
        spans = ", ".join(
            f"{b / 2**20:.1f}MB {s * 1e3:.0f}-{d * 1e3:.0f}"
            for b, s, d in zip(last["bucket_bytes"], last["bucket_launch_s"], last["bucket_done_s"])
        )
        lines.append(
            f"{LABELS[r.strategy]:<10} last step: backward ends {last['backward_s'] * 1e3:.0f} ms; "
            f"buckets (size launch-done ms): {spans}"
        )
    return "\n".join(lines)


def print_report(args: argparse.Namespace, cluster: EmulatedCluster, results: list[RunResult]) -> None:
    """Print the table, balance, targets, details and errors; optionally write JSON."""
    grad_mb = next((r.worker["grad_bytes"] / 1e6 for r in results if r.ok), float("nan"))
    print()
    print(
        f"emulated cluster: {NUM_NODES} nodes x 1 process, {args.rate_mbit:g} Mbit/s egress per node "
        f"(tbf burst {cluster.burst_bytes} B, latency {cluster.latency_ms} ms)\n"
        f"MLP {args.layers} x Linear({args.hidden}, {args.hidden}) = {grad_mb:.1f} MB of gradients, "
        f"batch {args.batch_size}/process, warmup {args.warmup} (+{args.profile_warmup_steps}+"
        f"{args.profile_steps} profiling for time), measured steps {args.steps}"
    )
    print(format_table(results))
    print()
    print(format_balance(results, args.rate_mbit))
    print(format_targets(results))
    print()
    print(format_details(results))
    for r in results:
        if not r.ok:
            print(f"\n[{LABELS[r.strategy]}] FAILED:\n{r.error}")
    if args.json_out:
        payload = {
            "config": report.config(args),
            "cluster": {"burst_bytes": cluster.burst_bytes, "latency_ms": cluster.latency_ms},
            "targets": {"time_vs_none": TARGET_VS_NONE, "time_vs_ddp": TARGET_VS_DDP},
            "results": [asdict(r) for r in results],
        }
        report.write_json(args.json_out, payload)
        print(f"\nwrote {args.json_out}")


def main(argv: list[str] | None = None) -> int:
    """Run all requested strategies on one emulated cluster; return a process exit code."""
    args = parse_args(argv)
    results: list[RunResult] = []
    t0 = time.monotonic()

    def run_all(cluster: EmulatedCluster) -> bool:
        results.extend(
            run_when_quiet(cluster, args, i, strategy) for i, strategy in enumerate(args.strategies)
        )
        print_report(args, cluster, results)
        return all(r.ok for r in results)

    code = run_on_cluster(
        run_all,
        num_nodes=NUM_NODES,
        rate_mbit=args.rate_mbit,
        subnet_prefix=SUBNET_PREFIX,
        name_prefix=NAME_PREFIX,
    )
    if code != 130:
        print(f"total {time.monotonic() - t0:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
