"""Time-planned vs size-capped vs no gradient buckets, and Lightning ``ddp``, on an emulated 2-node link.

Two network namespaces act as nodes, joined by a bridge; each node's egress is shaped to
``--rate-mbit`` (see ``netns_cluster.py``). For every strategy one worker process
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
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from netns_cluster import EmulatedCluster, Node, emulated_cluster

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
WORKER = HERE / "_time_buckets_worker.py"
NUM_NODES = 2
BASE_PORT = 29640
NAME_PREFIX = "lhtb"  # not "lhbench": must not tear down a concurrent bench_hier_sliced.py cluster
SUBNET_PREFIX = "10.78.0"
STRATEGIES = ("none", "size", "time", "ddp")
LABELS = {"none": "hier none", "size": "hier size", "time": "hier time", "ddp": "ddp"}
TARGET_VS_NONE = 0.85
TARGET_VS_DDP = 1.0
BUSY_HOST_CORES = 0.2  # CPU use by other processes (cores) above which a run is flagged as disturbed


def cpu_snapshot() -> tuple[float, float, float]:
    """``(wall, host busy CPU seconds, CPU seconds of this driver and its reaped children)``.

    Host busy time is user + nice + system from ``/proc/stat`` (all cores). The difference of two
    snapshots minus our own share is CPU that *other* processes used meanwhile: on a small host a
    concurrent job slows compute and skews the comparison, so runs are flagged when it is large.
    """
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    busy = (fields[0] + fields[1] + fields[2]) / os.sysconf("SC_CLK_TCK")
    ours = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        ours += usage.ru_utime + usage.ru_stime
    return time.monotonic(), busy, ours


def other_cores_between(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """Average number of cores used by processes other than ours between two snapshots."""
    wall = max(after[0] - before[0], 1e-9)
    return max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / wall


def wait_idle(timeout_s: float, sample_s: float = 2.0) -> float:
    """Wait (up to ``timeout_s``) until other processes use less than ``BUSY_HOST_CORES``; returns
    the last sampled use in cores."""
    deadline = time.monotonic() + timeout_s
    while True:
        before = cpu_snapshot()
        time.sleep(sample_s)
        other = other_cores_between(before, cpu_snapshot())
        if other <= BUSY_HOST_CORES or time.monotonic() >= deadline:
            return other
        print(f"  host busy ({other:.2f} cores used by other processes), waiting ...", flush=True)


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
    def other_cpu_cores(self) -> float:
        """Cores used by other processes, averaged over the measured window."""
        other = self.worker.get("other_cpu_cores_per_step") or []
        steps = self.worker.get("step_times_s") or []
        total = sum(steps[: len(other)])
        return sum(o * t for o, t in zip(other, steps)) / total if total > 0 else 0.0

    @property
    def disturbed(self) -> bool:
        """Whether other processes took a noticeable share of the CPU during the measured window."""
        return self.other_cpu_cores > BUSY_HOST_CORES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of the driver."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate-mbit", type=float, default=500, help="egress limit per node (Mbit/s)")
    p.add_argument("--hidden", type=int, default=1024, help="MLP width")
    p.add_argument("--layers", type=int, default=12, help="number of Linear(hidden, hidden) layers")
    p.add_argument("--batch-size", type=int, default=1280, help="per-process batch size")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps (for time: after profiling)")
    p.add_argument("--steps", type=int, default=8, help="measured steps")
    p.add_argument("--profile-steps", type=int, default=3, help="bucketing='time': profiled steps")
    p.add_argument(
        "--profile-warmup-steps", type=int, default=1, help="bucketing='time': steps before profiling"
    )
    p.add_argument("--min-bucket-mb", type=float, default=1.0, help="bucketing='time': smallest bucket")
    p.add_argument(
        "--bucket-cap-mb", type=float, default=None, help="hier_sliced bucket cap (default: the strategy's)"
    )
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated: none,size,time,ddp")
    p.add_argument("--json-out", type=Path, default=None, help="write all results as JSON here")
    p.add_argument("--timeout", type=float, default=300, help="seconds allowed per strategy run")
    p.add_argument("--keep-logs", action="store_true", help="keep the per-run temp dir with worker logs")
    p.add_argument(
        "--wait-idle",
        type=float,
        default=0,
        help="before each strategy, wait up to this many seconds for other processes to leave the CPU",
    )
    p.add_argument(
        "--retry-busy",
        type=int,
        default=0,
        help="rerun a strategy (after --wait-idle) up to this many times when other processes used the CPU",
    )
    args = p.parse_args(argv)
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = set(args.strategies) - set(STRATEGIES)
    if unknown:
        p.error(f"unknown strategies: {sorted(unknown)}")
    return args


def worker_env(cluster: EmulatedCluster, node: Node, port: int, run_id: str) -> dict[str, str]:
    """Environment of the worker of ``node``, as torchrun would set it (one process per node)."""
    world_size = len(cluster.nodes)
    rank = node.index
    env = dict(os.environ)
    env.update(
        {
            "MASTER_ADDR": cluster.nodes[0].ip,
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world_size),
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(node.index),
            "NODE_RANK": str(node.index),
            "GROUP_WORLD_SIZE": str(world_size),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world_size),
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "GLOO_SOCKET_IFNAME": node.ifname,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def worker_argv(args: argparse.Namespace, strategy: str, out: Path) -> list[str]:
    """Command line of one worker."""
    argv = [
        sys.executable,
        str(WORKER),
        "--strategy",
        strategy,
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--batch-size",
        str(args.batch_size),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--profile-steps",
        str(args.profile_steps),
        "--profile-warmup-steps",
        str(args.profile_warmup_steps),
        "--min-bucket-mb",
        str(args.min_bucket_mb),
        "--out",
        str(out),
        "--pid-dir",
        str(out.parent),
    ]
    if args.bucket_cap_mb is not None:
        argv += ["--bucket-cap-mb", str(args.bucket_cap_mb)]
    return argv


def log_tail(workdir: Path, lines: int = 25) -> str:
    """Last lines of every worker log, for error reports."""
    parts = []
    for log in sorted(workdir.glob("rank*.log")):
        text = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log.name} ---\n" + "\n".join(text))
    return "\n".join(parts)


def run_strategy(cluster: EmulatedCluster, args: argparse.Namespace, strategy: str, port: int) -> RunResult:
    """Run one strategy (one worker per node) and collect rank 0's timings."""
    workdir = Path(tempfile.mkdtemp(prefix=f"{NAME_PREFIX}-{strategy}-"))
    print(f"[{LABELS[strategy]}] running {NUM_NODES} workers (logs: {workdir}) ...", flush=True)
    t0 = time.monotonic()
    before = cpu_snapshot()
    try:
        argv = worker_argv(args, strategy, workdir / "rank0.json")
        run_id = f"{NAME_PREFIX}-{strategy}-{os.getpid()}"
        procs = []
        for node in cluster.nodes:
            with open(workdir / f"rank{node.index}.log", "wb") as log:
                env = worker_env(cluster, node, port, run_id)
                procs.append(
                    cluster.popen(node, argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
                )
        deadline = t0 + args.timeout
        while True:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                raise RuntimeError(f"worker failed, exit codes {codes}")
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"strategy run exceeded {args.timeout} s")
            time.sleep(0.05)
        other = other_cores_between(before, cpu_snapshot())
        worker = json.loads((workdir / "rank0.json").read_text())
        return RunResult(
            strategy, True, wall_s=time.monotonic() - t0, other_cpu_cores_run=other, worker=worker
        )
    except Exception as exc:  # report and continue with the next strategy
        return RunResult(
            strategy, ok=False, error=f"{exc}\n{log_tail(workdir)}", wall_s=time.monotonic() - t0
        )
    finally:
        cluster.kill_processes()
        if not args.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)


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
    rows = [header, "-" * len(header)]
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
            f"{r.other_cpu_cores:>10.2f} {quiet:>16}"
        )
    busy = [LABELS[r.strategy] for r in results if r.ok and r.disturbed]
    if busy:
        rows.append(
            f"WARNING: other processes used > {BUSY_HOST_CORES} cores while measuring {busy}: "
            "their step times are inflated; rerun on a quiet host (or see 'quiet steps')"
        )
    return "\n".join(rows)


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


def report(args: argparse.Namespace, cluster: EmulatedCluster, results: list[RunResult]) -> None:
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
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "cluster": {"burst_bytes": cluster.burst_bytes, "latency_ms": cluster.latency_ms},
            "targets": {"time_vs_none": TARGET_VS_NONE, "time_vs_ddp": TARGET_VS_DDP},
            "results": [asdict(r) for r in results],
        }
        args.json_out.write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {args.json_out}")


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """Turn SIGTERM into SystemExit so that workers and namespaces are cleaned up."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Run all requested strategies on one emulated cluster; return a process exit code."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    results: list[RunResult] = []
    t0 = time.monotonic()
    try:
        with emulated_cluster(
            num_nodes=NUM_NODES,
            rate_mbit=args.rate_mbit,
            subnet_prefix=SUBNET_PREFIX,
            name_prefix=NAME_PREFIX,
        ) as cluster:
            for i, strategy in enumerate(args.strategies):
                for attempt in range(args.retry_busy + 1):
                    if args.wait_idle > 0:
                        wait_idle(args.wait_idle)
                    result = run_strategy(cluster, args, strategy, BASE_PORT + 10 * attempt + i)
                    if not result.ok or not result.disturbed:
                        break
                    if attempt < args.retry_busy:
                        busy = result.other_cpu_cores
                        print(
                            f"  other processes used {busy:.2f} cores while measuring; retrying", flush=True
                        )
                results.append(result)
            report(args, cluster, results)
    except KeyboardInterrupt:
        print("\ninterrupted; workers stopped and emulated cluster removed", file=sys.stderr)
        return 130
    print(f"total {time.monotonic() - t0:.0f} s")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
