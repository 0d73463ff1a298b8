"""Lightning ``ddp`` vs ``hier_sliced`` (and ``hier_bsp``) on an emulated 2-node x 2-device cluster: step time
and link bytes.

Needs root and iproute2. What it sets up and measures, and the options: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field

from harness import cli, jobs, report
from harness.cluster import EmulatedCluster, StrategyRun, run_on_cluster, run_workers

WORKER = jobs.BENCH_DIR / "_hier_sliced_worker.py"
CONTENDER, REFERENCE, BSP = "hier_sliced", "ddp", "hier_bsp"
DEVICES_PER_NODE, BASE_PORT, LR = 2, 29540, 1e-3
# hier_sliced's step time against ddp's, its bytes per node against the bound, hier_bsp's median step
TARGET_STEP_RATIO, TARGET_BYTES_X_BOUND, TARGET_BSP_MEDIAN_RATIO = 0.70, 1.1, 0.5
# with a 16-bit inter-node hop: step time and bytes on the slow link against fp32's bound
TARGET_NARROW_STEP_RATIO, TARGET_NARROW_BYTES_X_BOUND = 0.45, 0.55
WORKER_OPTIONS = ("hidden", "layers", "batch_size", "warmup", "steps")
OPTIONS = """
--rate-mbit     float  200              egress limit per node (Mbit/s)
--steps         int    8                measured steps
--warmup        int    3                warm-up steps before measuring
--hidden        int    1024             MLP width
--layers        int    6                number of Linear(hidden, hidden) layers
--batch-size    int    8                per-process batch size
--bucket-cap-mb float  25.0             bucket cap for both strategies (MB)
--strategies    str    ddp,hier_sliced  comma-separated: ddp, hier_sliced, hier_bsp
--superstep-steps int  4                hier_bsp: superstep (a step count)
--max-staleness int    1                hier_bsp: max_staleness
--repeats       int    1                run every strategy this many times (interleaved); median ratio
--inter-node-dtype str ""               hier_sliced: inter_node_dtype (bf16, fp16, int8; "": full precision)
--comm-chunk-mb float  0                hier_sliced: its _comm_chunk_mb (chunks of a bucket; 0: automatic)
"""


@dataclass
class Run(StrategyRun):
    """Also the nodes' ``tx_bytes`` when rank 0 handed over at "start" and "end"."""

    tx_bytes: dict[str, list[int]] = field(default_factory=dict)

    @property
    def node_bytes(self) -> list[float]:
        """Bytes each node sent per measured step."""
        return [(e - s) / self.worker["steps"] for s, e in zip(self.tx_bytes["start"], self.tx_bytes["end"])]

    @property
    def bound(self) -> float:
        """Bandwidth-optimal bytes per node and step, ``2 (N - 1) / N * S``."""
        n = self.worker["num_nodes"]
        return 2 * (n - 1) / n * self.worker["grad_bytes"]


def run_strategy(cluster: EmulatedCluster, args: argparse.Namespace, strategy: str, port: int) -> Run:
    """Run one strategy; the nodes' ``tx_bytes`` are read whenever rank 0 hands over."""
    strategy_options: dict = {"bucket_cap_mb": args.bucket_cap_mb}
    if strategy == BSP:
        strategy_options.update(superstep=args.superstep_steps, max_staleness=args.max_staleness)
    if strategy == CONTENDER:
        if args.comm_chunk_mb > 0:
            strategy_options["_comm_chunk_mb"] = args.comm_chunk_mb
        if args.inter_node_dtype:
            strategy_options["inter_node_dtype"] = args.inter_node_dtype
    options = {"strategy_options": strategy_options, "record": "handover", "lr": LR}
    config = {"strategy": strategy, **options, **jobs.pick(args, *WORKER_OPTIONS)}
    argv = [sys.executable, str(WORKER), "--config", json.dumps(config)]
    tx: dict[str, list[int]] = {}
    read_tx = lambda phase: tx.update({phase: [cluster.tx_bytes(n) for n in cluster.nodes]})
    try:
        worker = run_workers(cluster, argv, f"lhbench-{strategy}", DEVICES_PER_NODE, port, args, read_tx)
    except Exception as exc:  # report it and go on with the next strategy
        return Run(strategy, ok=False, error=str(exc))
    return Run(strategy, worker=worker, tx_bytes=tx)


def verdict(value: float, target: float) -> str:
    """Whether ``value`` is within ``target`` (n/a for nan)."""
    return "n/a" if value != value else ("MET" if value <= target else "NOT MET")


def table_row(r: Run, ddp: Run | None) -> str:
    """One strategy's line of the table."""
    if not r.ok:
        return f"{r.strategy:<12} FAILED (see below)"
    ratio = f"{r.step_s / ddp.step_s:.3f}" if ddp else "n/a"
    nodes = " ".join(f"{b / 1e6:>14.2f} {b / r.bound:>8.3f}" for b in r.node_bytes)
    mbit = max(r.node_bytes) * 8 / r.step_s / 1e6
    sizes = f"{r.worker['grad_bytes'] / 1e6:>8.2f} {r.bound / 1e6:>9.2f}"
    return f"{r.strategy:<12} {r.step_s:>9.3f} {ratio:>7} {sizes} {nodes} {mbit:>12.1f}"


def loss_drop(r: Run) -> tuple[float, float, float]:
    """Rank 0's mean loss over the first and the last quarter of the window, and the drop per second."""
    losses = r.worker["losses"]
    k = max(1, len(losses) // 4)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    return first, last, (first - last) / (r.worker["window_s"] * (len(losses) - k) / len(losses))


def print_bsp_target(bsp: Run, ddp: Run) -> None:
    """hier_bsp's median micro-step time against ddp's, and whether its loss still falls in the window."""
    median = lambda r: r.worker["median_step_s"]
    ratio = median(bsp) / median(ddp)
    (first, last, rate), (_, _, ddp_rate) = loss_drop(bsp), loss_drop(ddp)
    options = bsp.worker["strategy_options"]
    print(
        f"  hier_bsp (superstep={options['superstep']}, "
        f"max_staleness={options['max_staleness']}): "
        f"median step {median(bsp):.3f} s vs ddp {median(ddp):.3f} s = {ratio:.3f} x (target <= "
        f"{TARGET_BSP_MEDIAN_RATIO}) -> {verdict(ratio, TARGET_BSP_MEDIAN_RATIO)}; mean step "
        f"{bsp.step_s / ddp.step_s:.3f} x ddp's\n  rank 0 loss {first:.9f} -> {last:.9f} over the window "
        f"({'falling' if last < first else 'NOT falling'}); loss drop per second {rate:.3g} "
        f"(ddp {ddp_rate:.3g})"
    )


def print_report(args: argparse.Namespace, cluster: EmulatedCluster, results: list[Run]) -> float:
    """The set-up, the table, the targets and the errors; returns hier_sliced's step-time ratio."""
    done = {r.strategy: r for r in results if r.ok}
    header = (
        f"{'strategy':<12} {'step [s]':>9} {'vs ddp':>7} {'grad MB':>8} {'bound MB':>9} "
        f"{'node0 MB/step':>14} {'x bound':>8} {'node1 MB/step':>14} {'x bound':>8} {'Mbit/s/node':>12}"
    )
    print(
        f"\n{cluster.describe(DEVICES_PER_NODE)}\nMLP {args.layers} x Linear({args.hidden}, {args.hidden}), "
        f"batch {args.batch_size}/process, warmup {args.warmup}, measured steps {args.steps}"
    )
    print(report.text_table(header, [table_row(r, done.get(REFERENCE)) for r in results]))
    narrow = bool(args.inter_node_dtype)
    step_target = TARGET_NARROW_STEP_RATIO if narrow else TARGET_STEP_RATIO
    bytes_target = TARGET_NARROW_BYTES_X_BOUND if narrow else TARGET_BYTES_X_BOUND
    print(
        f"\ntargets{f' (inter_node_dtype={args.inter_node_dtype})' if narrow else ''}: hier_sliced/ddp step "
        f"time <= {step_target}; hier_sliced bytes per node per step <= {bytes_target} x (fp32) bound"
    )
    hier, ddp = done.get(CONTENDER), done.get(REFERENCE)
    ratio = hier.step_s / ddp.step_s if hier and ddp else float("nan")
    worst = max(hier.node_bytes) / hier.bound if hier else float("nan")
    print(f"  step-time ratio {ratio:.3f} -> {verdict(ratio, step_target)}")
    print(f"  bytes {worst:.3f} x bound (worst node) -> {verdict(worst, bytes_target)}")
    if BSP in done and ddp:
        print_bsp_target(done[BSP], ddp)
    report.print_failures([(f"[{r.strategy}]", r.error) for r in results if not r.ok])
    return ratio


def main(argv: list[str] | None = None) -> int:
    """Run the requested strategies on one emulated cluster and report; returns the exit code."""
    run_options = cli.RUN_OPTIONS.format(timeout=600, per="strategy run", logs="the per-run temp dir")
    p = cli.parser(__doc__, OPTIONS, run_options)
    args = p.parse_args(argv)
    args.strategies = cli.comma_list(args.strategies)
    if not set(args.strategies) <= {REFERENCE, CONTENDER, BSP}:
        p.error(f"--strategies: choose from {REFERENCE}, {CONTENDER}, {BSP}")

    def run_all(cluster: EmulatedCluster) -> bool:
        repeats: list[list[Run]] = []
        ratios: list[float] = []
        for repeat in range(args.repeats):
            if args.repeats > 1:
                print(f"\n=== repeat {repeat + 1} of {args.repeats}", flush=True)
            ports = (BASE_PORT + 10 * repeat + i for i in range(len(args.strategies)))
            repeats.append([run_strategy(cluster, args, s, port) for s, port in zip(args.strategies, ports)])
            ratios.append(print_report(args, cluster, repeats[-1]))
        valid = sorted(r for r in ratios if r == r)
        if args.repeats > 1 and valid:
            median = statistics.median(valid)
            print(
                f"\nhier_sliced / ddp step time over {len(valid)} repeats: median {median:.3f} "
                f"(runs {', '.join(f'{r:.3f}' for r in ratios)}) -> "
                f"{verdict(median, TARGET_NARROW_STEP_RATIO if args.inter_node_dtype else TARGET_STEP_RATIO)}"
            )
        payload = {"config": report.config(args), "ratios": ratios}
        payload["repeats"] = [[asdict(r) for r in results] for results in repeats]
        report.save_json(args.json_out, lambda: payload)
        return all(r.ok for results in repeats for r in results)

    return run_on_cluster(run_all, num_nodes=2, rate_mbit=args.rate_mbit)


if __name__ == "__main__":
    sys.exit(main())
