"""Compare Lightning ``ddp`` with ``hier_sliced`` on an emulated 2-node x 2-device cluster.

Two network namespaces joined by a bridge act as nodes, each with its egress shaped to ``--rate-mbit``
(``harness/cluster.py``). Per strategy, four workers (``_hier_sliced_worker.py``) train a
communication-bound MLP, ranks 0-1 in node 0 and 2-3 in node 1; the driver reads both nodes'
``tx_bytes`` when rank 0 marks the start and the end of the measured window. Printed per strategy:
mean step time, its ratio to ddp, and the bytes each node sent per step as a multiple of the
bandwidth-optimal bound ``2 (N - 1) / N * S`` (N nodes, S gradient bytes); then the targets for
hier_sliced (step time <= 0.75 x ddp, bytes <= 1.1 x bound). Details: benchmarks/README.md.

Needs root and iproute2::

    sudo python benchmarks/bench_hier_sliced.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness import cli, jobs, report
from harness.cluster import EmulatedCluster, launch, logs_tail, run_on_cluster, watch

WORKER = jobs.BENCH_DIR / "_hier_sliced_worker.py"
CONTENDER, REFERENCE = "hier_sliced", "ddp"
NUM_NODES, DEVICES_PER_NODE, BASE_PORT = 2, 2, 29540
TARGET_STEP_RATIO = 0.75
TARGET_BYTES_X_BOUND = 1.1
PHASES = ("start", "end")
OPTIONS = """
--rate-mbit     float  200              egress limit per node (Mbit/s)
--steps         int    8                measured steps
--warmup        int    3                warm-up steps before measuring
--hidden        int    1024             MLP width
--layers        int    6                number of Linear(hidden, hidden) layers
--batch-size    int    8                per-process batch size
--bucket-cap-mb float  25.0             bucket cap for both strategies (MB)
--strategies    str    ddp,hier_sliced  comma-separated: ddp, hier_sliced
"""
WORKER_OPTIONS = ("hidden", "layers", "batch_size", "warmup", "steps", "bucket_cap_mb")


@dataclass
class RunResult:
    """Outcome of one strategy run."""

    strategy: str
    ok: bool
    error: str = ""
    worker: dict[str, Any] = field(default_factory=dict)
    tx_bytes: dict[str, list[int]] = field(default_factory=dict)

    @property
    def step_s(self) -> float:
        """Mean wall time per measured step (start-to-start)."""
        return float(self.worker["mean_step_s"])

    def bytes_per_step(self) -> list[float]:
        """Bytes each node sent per measured step."""
        start, end = self.tx_bytes["start"], self.tx_bytes["end"]
        return [(e - s) / self.worker["steps"] for s, e in zip(start, end, strict=True)]

    def bound_bytes(self) -> float:
        """Bandwidth-optimal per-node bytes per step, ``2 (N-1)/N * S``."""
        n = self.worker["num_nodes"]
        return 2 * (n - 1) / n * self.worker["grad_bytes"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of the driver."""
    run_options = cli.RUN_OPTIONS.format(timeout=600, per="strategy run", logs="the per-run temp dir")
    p = cli.parser(__doc__, OPTIONS, run_options)
    args = p.parse_args(argv)
    args.strategies = cli.comma_list(args.strategies)
    unknown = set(args.strategies) - {REFERENCE, CONTENDER}
    if unknown:
        p.error(f"unknown strategies: {sorted(unknown)}")
    return args


def worker_argv(args: argparse.Namespace, strategy: str, workdir: Path) -> list[str]:
    """Command line of one worker."""
    options = jobs.pick(args, *WORKER_OPTIONS)
    flags = jobs.flags(strategy=strategy, **options, signal_dir=workdir, out=workdir / "rank0.json")
    return [sys.executable, str(WORKER), *flags]


def run_strategy(cluster: EmulatedCluster, args: argparse.Namespace, strategy: str, port: int) -> RunResult:
    """Run one strategy; the nodes' ``tx_bytes`` are read whenever rank 0 marks a phase."""
    with jobs.job_dir(f"lhbench-{strategy}-", args.keep_logs, stop=cluster.kill_processes) as workdir:
        print(f"[{strategy}] running 4 workers (logs: {workdir}) ...", flush=True)
        try:
            run_id = f"lhbench-{strategy}-{os.getpid()}"
            procs = launch(
                cluster, worker_argv(args, strategy, workdir), workdir, DEVICES_PER_NODE, port, run_id
            )
            markers, tx = jobs.Markers(workdir, PHASES), {}
            read_counters = lambda phase: tx.update({phase: cluster.tx_bytes_all()})
            watch(procs, args.timeout, 0.002, lambda: markers.answer(read_counters))
            if markers.missing:
                raise RuntimeError(f"workers finished without signalling phases {markers.missing}")
            return RunResult(
                strategy, ok=True, worker=json.loads((workdir / "rank0.json").read_text()), tx_bytes=tx
            )
        except Exception as exc:  # report and continue with the next strategy
            return RunResult(strategy, ok=False, error=f"{exc}\n{logs_tail(workdir)}")


def format_table(results: list[RunResult]) -> str:
    """Human-readable comparison table."""
    ddp = next((r for r in results if r.ok and r.strategy == REFERENCE), None)
    header = (
        f"{'strategy':<12} {'step [s]':>9} {'vs ddp':>7} {'grad MB':>8} {'bound MB':>9} "
        f"{'node0 MB/step':>14} {'x bound':>8} {'node1 MB/step':>14} {'x bound':>8} {'Mbit/s/node':>12}"
    )
    rows = []
    for r in results:
        if not r.ok:
            rows.append(f"{r.strategy:<12} FAILED (see below)")
            continue
        ratio = f"{r.step_s / ddp.step_s:.3f}" if ddp else "n/a"
        bps, bound = r.bytes_per_step(), r.bound_bytes()
        cells = " ".join(f"{b / 1e6:>14.2f} {b / bound:>8.3f}" for b in bps)
        mbit = max(bps) * 8 / r.step_s / 1e6
        rows.append(
            f"{r.strategy:<12} {r.step_s:>9.3f} {ratio:>7} {r.worker['grad_bytes'] / 1e6:>8.2f} "
            f"{bound / 1e6:>9.2f} {cells} {mbit:>12.1f}"
        )
    return report.text_table(header, rows)


def format_targets(results: list[RunResult]) -> str:
    """Targets for hier_sliced and whether they are met."""
    ddp = next((r for r in results if r.ok and r.strategy == REFERENCE), None)
    hier = next((r for r in results if r.strategy == CONTENDER), None)
    lines = [
        f"targets: hier_sliced/ddp step time <= {TARGET_STEP_RATIO}; "
        f"hier_sliced bytes per node per step <= {TARGET_BYTES_X_BOUND} x bound"
    ]
    if hier is None or not hier.ok:
        return "\n".join([*lines, "  hier_sliced: not run or failed -> targets not evaluated"])
    if ddp is None:
        lines.append("  step-time ratio: ddp not run -> not evaluated")
    else:
        ratio = hier.step_s / ddp.step_s
        lines.append(f"  step-time ratio {ratio:.3f} -> {'MET' if ratio <= TARGET_STEP_RATIO else 'NOT MET'}")
    worst = max(hier.bytes_per_step()) / hier.bound_bytes()
    lines.append(
        f"  bytes {worst:.3f} x bound (worst node) -> {'MET' if worst <= TARGET_BYTES_X_BOUND else 'NOT MET'}"
    )
    return "\n".join(lines)


def print_report(args: argparse.Namespace, cluster: EmulatedCluster, results: list[RunResult]) -> None:
    """Print the table, targets and errors; optionally write JSON."""
    print()
    print(
        f"emulated cluster: {NUM_NODES} nodes x {DEVICES_PER_NODE} devices, {args.rate_mbit:g} Mbit/s egress "
        f"per node (tbf burst {cluster.burst_bytes} B, latency {cluster.latency_ms} ms)\n"
        f"MLP {args.layers} x Linear({args.hidden}, {args.hidden}), batch {args.batch_size}/process, "
        f"warmup {args.warmup}, measured steps {args.steps}"
    )
    print(format_table(results))
    print()
    print(format_targets(results))
    report.print_failures([(f"[{r.strategy}]", r.error) for r in results if not r.ok])
    report.save_json(
        args.json_out, lambda: {"config": report.config(args), "results": [asdict(r) for r in results]}
    )


def main(argv: list[str] | None = None) -> int:
    """Run all requested strategies on one emulated cluster; return a process exit code."""
    args = parse_args(argv)

    def run_all(cluster: EmulatedCluster) -> bool:
        results = [run_strategy(cluster, args, s, BASE_PORT + i) for i, s in enumerate(args.strategies)]
        print_report(args, cluster, results)
        return all(r.ok for r in results)

    return run_on_cluster(run_all, num_nodes=NUM_NODES, rate_mbit=args.rate_mbit)


if __name__ == "__main__":
    sys.exit(main())
