"""hier_sliced (fp32, bf16 and int8 inter-node hop) against Lightning ``ddp``, torch FSDP2 HSDP and torch DDP
with its bf16 compression hook on an emulated 2-node x 2-device cluster: step time and link bytes.

Needs root and iproute2. What it sets up and measures, and the options: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from harness import cli, jobs, report
from harness.cluster import EmulatedCluster, StrategyRun, run_on_cluster, run_workers

WORKER = jobs.BENCH_DIR / "_hier_sliced_worker.py"
REFERENCE, HSDP, BSP = "ddp", "hsdp", "hier_bsp"
# contender: (the worker's strategy, its options beyond bucket_cap_mb)
CONTENDERS: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp": ("ddp", {}),
    "hsdp": ("hsdp", {}),
    "ddp_bf16": ("ddp_bf16", {}),
    "hier_sliced": ("hier_sliced", {}),
    "hier_sliced_bf16": ("hier_sliced", {"inter_node_dtype": "bf16"}),
    "hier_sliced_int8": ("hier_sliced", {"inter_node_dtype": "int8"}),
    "hier_sliced_fp8": ("hier_sliced", {"inter_node_dtype": "fp8"}),
    "hier_sliced_fp16": ("hier_sliced", {"inter_node_dtype": "fp16"}),
    "hier_bsp": ("hier_bsp", {}),
    "hier_bsp_bf16": ("hier_bsp", {"inter_node_dtype": "bf16"}),
    "hier_bsp_int8": ("hier_bsp", {"inter_node_dtype": "int8"}),
}
OPTIONAL = ("hier_sliced_fp16", "hier_sliced_fp8")  # run when named in --contenders
DEFAULT_CONTENDERS = [name for name in CONTENDERS if not name.startswith(BSP) and name not in OPTIONAL]
DEVICES_PER_NODE, BASE_PORT, LR = 2, 29540, 1e-3
# per hier_sliced contender: (median step time against ddp's, worst node's bytes against the fp32 bound)
TARGETS = {
    "hier_sliced": (0.70, 1.1), "hier_sliced_bf16": (0.45, 0.55), "hier_sliced_int8": (0.30, 0.30),
    "hier_sliced_fp8": (0.30, 0.30),
}  # fmt: skip
TARGET_BSP_MEDIAN_RATIO = 0.5
# every contender computes the first step's loss from the same parameters and batch
FIRST_LOSS_RTOL = 1e-6
WORKER_OPTIONS = ("hidden", "layers", "batch_size", "warmup", "steps")
OPTIONS = """
--rate-mbit     float  200              egress limit per node (Mbit/s)
--steps         int    8                measured steps
--warmup        int    3                warm-up steps before measuring
--hidden        int    1024             MLP width
--layers        int    6                number of Linear(hidden, hidden) layers
--batch-size    int    8                per-process batch size
--bucket-cap-mb float  25.0             bucket cap of ddp, ddp_bf16, hier_sliced*, hier_bsp (MB)
--contenders    str    default          comma-separated (README); default: all but hier_bsp*, _fp16, _fp8
--inter-node-dtype str ""               bf16, fp16, int8, fp8: means --contenders ddp,hsdp,hier_sliced_<it>
--superstep-steps int  4                hier_bsp: superstep (a step count)
--max-staleness int    1                hier_bsp: max_staleness
--repeats       int    1                run every contender this many times, interleaved; medians
--comm-chunk-mb float  0                hier_sliced*: its _comm_chunk_mb (chunks of a bucket; 0: automatic)
"""


@dataclass
class Run(StrategyRun):
    """Also the nodes' ``tx_bytes`` and a CPU snapshot when rank 0 handed over at "start" and "end"."""

    tx_bytes: dict[str, list[int]] = field(default_factory=dict)
    cpu: dict[str, tuple[float, float, float]] = field(default_factory=dict)

    @property
    def node_bytes(self) -> list[float]:
        """Bytes each node sent per measured step."""
        return [(e - s) / self.worker["steps"] for s, e in zip(self.tx_bytes["start"], self.tx_bytes["end"])]

    @property
    def bound(self) -> float:
        """Bandwidth-optimal fp32 bytes per node and step, ``2 (N - 1) / N * S``."""
        n = self.worker["num_nodes"]
        return 2 * (n - 1) / n * self.worker["grad_bytes"]

    @property
    def bytes_x_bound(self) -> float:
        """The worst node's bytes per step against the fp32 bound."""
        return max(self.node_bytes) / self.bound

    @property
    def other_cores(self) -> float:
        """Cores that processes outside this run used during the measured window."""
        return jobs.other_cores(self.cpu["start"], self.cpu["end"]) if len(self.cpu) == 2 else float("nan")


def run_contender(cluster: EmulatedCluster, args: argparse.Namespace, name: str, port: int) -> Run:
    """Run one contender; the nodes' ``tx_bytes`` and the host's CPU are read whenever rank 0 hands over."""
    strategy, extra = CONTENDERS[name]
    strategy_options: dict = {} if strategy == HSDP else {"bucket_cap_mb": args.bucket_cap_mb, **extra}
    if strategy == BSP:
        strategy_options.update(superstep=args.superstep_steps, max_staleness=args.max_staleness)
    if strategy == "hier_sliced" and args.comm_chunk_mb > 0:
        strategy_options["_comm_chunk_mb"] = args.comm_chunk_mb
    options = {"strategy_options": strategy_options, "record": "handover", "lr": LR}
    config = {"strategy": strategy, **options, **jobs.pick(args, *WORKER_OPTIONS)}
    argv = [sys.executable, str(WORKER), "--config", json.dumps(config)]
    run = Run(name)

    def at_phase(phase: str) -> None:
        run.tx_bytes[phase] = [cluster.tx_bytes(n) for n in cluster.nodes]
        run.cpu[phase] = jobs.cpu_snapshot(cluster.pids())

    try:
        run.worker = run_workers(cluster, argv, f"lhbench-{name}", DEVICES_PER_NODE, port, args, at_phase)
    except Exception as exc:  # report it and go on with the next contender
        run.ok, run.error = False, str(exc)
    return run


def verdict(ok: bool | None) -> str:
    """MET, NOT MET, or n/a (None)."""
    return "n/a" if ok is None else ("MET" if ok else "NOT MET")


def ratio(r: Run, to: Run | None) -> float:
    """``r``'s mean step time over ``to``'s (nan when either is missing)."""
    return r.step_s / to.step_s if r.ok and to is not None and to.ok else float("nan")


def table_row(r: Run, done: dict[str, Run]) -> str:
    """One contender's line of a repeat's table."""
    if not r.ok:
        return f"{r.strategy:<17} FAILED (see below)"
    nodes = " ".join(f"{b / 1e6:>8.2f} {b / r.bound:>6.3f}" for b in r.node_bytes)
    mbit = max(r.node_bytes) * 8 / r.step_s / 1e6
    vs = " ".join(report.fmt(ratio(r, done.get(n)), ">7.3f") for n in (REFERENCE, HSDP))
    return (
        f"{r.strategy:<17} {r.step_s:>8.3f} {vs} {r.bound / 1e6:>8.2f} {nodes} {mbit:>7.1f} "
        f"{report.fmt(r.other_cores):>6} {r.worker['first_loss']:>12.9f} {r.worker['last_loss']:>12.9f}"
    )


def loss_drop(r: Run) -> tuple[float, float, float]:
    """Rank 0's mean loss over the first and the last quarter of the window, and the drop per second."""
    losses = r.worker["losses"]
    k = max(1, len(losses) // 4)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    return first, last, (first - last) / (r.worker["window_s"] * (len(losses) - k) / len(losses))


def is_bsp(name: str) -> bool:
    """Whether contender ``name`` runs ``hier_bsp`` (with any push)."""
    return CONTENDERS[name][0] == BSP


def print_bsp_target(bsp: Run, ddp: Run, full: Run | None = None) -> None:
    """hier_bsp's median micro-step time against ddp's, and whether its loss still falls in the window; for a
    compressed push, also its mean step, bytes and loss drop per second against the full-precision push's
    (``full``)."""
    median = lambda r: r.worker["median_step_s"]
    value = median(bsp) / median(ddp)
    (first, last, rate), (_, _, ddp_rate) = loss_drop(bsp), loss_drop(ddp)
    options = bsp.worker["strategy_options"]
    dtype = options.get("inter_node_dtype")
    print(
        f"  {bsp.strategy} (superstep={options['superstep']}, "
        f"max_staleness={options['max_staleness']}{f', inter_node_dtype={dtype}' if dtype else ''}): "
        f"median step {median(bsp):.3f} s vs ddp {median(ddp):.3f} s = {value:.3f} x (target <= "
        f"{TARGET_BSP_MEDIAN_RATIO}) -> {verdict(value <= TARGET_BSP_MEDIAN_RATIO)}; mean step "
        f"{bsp.step_s / ddp.step_s:.3f} x ddp's\n  rank 0 loss {first:.9f} -> {last:.9f} over the window "
        f"({'falling' if last < first else 'NOT falling'}); loss drop per second {rate:.3g} "
        f"(ddp {ddp_rate:.3g})"
    )
    if full is not None and full is not bsp:
        print(
            f"    against {full.strategy}: mean step {ratio(bsp, full):.3f} x, bytes per node "
            f"{max(bsp.node_bytes) / max(full.node_bytes):.3f} x, loss drop per second "
            f"{rate / loss_drop(full)[2]:.3f} x"
        )


def first_loss_check(results: list[Run]) -> bool:
    """Whether every contender's first-step loss (rank 0's) equals ddp's (or the first one's) within
    ``FIRST_LOSS_RTOL``: the same model, parameters and batch; prints the outliers."""
    done = [r for r in results if r.ok]
    if not done:
        return True
    base = next((r for r in done if r.strategy == REFERENCE), done[0])
    ref = base.worker["first_loss"]
    off = [r for r in done if abs(r.worker["first_loss"] - ref) > FIRST_LOSS_RTOL * abs(ref)]
    others = ", ".join(f"{r.strategy} {r.worker['first_loss']:.9f}" for r in off)
    print(
        f"  first-step loss: {len(done) - len(off)} of {len(done)} contenders equal {base.strategy}'s "
        f"{ref:.9f} (rtol {FIRST_LOSS_RTOL:g}){'; differ: ' + others if off else ''}"
    )
    return not off


def print_repeat(args: argparse.Namespace, cluster: EmulatedCluster, results: list[Run]) -> bool:
    """One repeat's set-up, table, loss check and errors; returns whether the first-step losses agree."""
    done = {r.strategy: r for r in results if r.ok}
    header = (
        f"{'contender':<17} {'step [s]':>8} {'vs ddp':>7} {'vs hsdp':>7} {'bound MB':>8} {'node0 MB':>8} "
        f"{'xbound':>6} {'node1 MB':>8} {'xbound':>6} {'Mbit/s':>7} {'others':>6} {'first loss':>12} "
        f"{'last loss':>12}"
    )
    print(
        f"\n{cluster.describe(DEVICES_PER_NODE)}\nMLP {args.layers} x Linear({args.hidden}, {args.hidden}), "
        f"batch {args.batch_size}/process, warmup {args.warmup}, measured steps {args.steps}; "
        f"'others': cores used by other processes in the window"
    )
    print(report.text_table(header, [table_row(r, done) for r in results]))
    agree = first_loss_check(results)
    if REFERENCE in done:
        for name in (n for n in done if is_bsp(n)):
            print_bsp_target(done[name], done[REFERENCE], done.get(BSP))
    report.print_failures([(f"[{r.strategy}]", r.error) for r in results if not r.ok])
    return agree


def spread(values: list[float], spec: str = ".3f") -> str:
    """``median (v1, v2, ...)`` of the values in their run order."""
    return f"{statistics.median(values):{spec}} ({', '.join(format(v, spec) for v in values)})"


def summarize(contenders: list[str], repeats: list[list[Run]]) -> dict[str, dict[str, Any]]:
    """Per contender over the repeats where it and its anchors ran: step times, ratios to ddp and to HSDP,
    the worst node's bytes against the fp32 bound, the host's load and the losses."""
    out: dict[str, dict[str, Any]] = {}
    for name in contenders:
        runs = [{r.strategy: r for r in results if r.ok} for results in repeats]
        mine = [done for done in runs if name in done]
        if not mine:
            continue
        out[name] = {
            "step_s": [done[name].step_s for done in mine],
            "vs_ddp": [ratio(done[name], done.get(REFERENCE)) for done in mine],
            "vs_hsdp": [ratio(done[name], done.get(HSDP)) for done in mine],
            "vs_bsp": [ratio(done[name], done.get(BSP)) if is_bsp(name) else float("nan") for done in mine],
            "node_mb": [max(done[name].node_bytes) / 1e6 for done in mine],
            "bytes_x_bound": [done[name].bytes_x_bound for done in mine],
            "other_cores": [done[name].other_cores for done in mine],
            "first_loss": [done[name].worker["first_loss"] for done in mine],
            "last_loss": [done[name].worker["last_loss"] for done in mine],
        }
    return out


def finite(values: list[float]) -> list[float]:
    """The values that are not nan."""
    return [v for v in values if v == v]


def print_summary(summary: dict[str, dict[str, Any]], repeats: int) -> None:
    """Medians over the repeats (each repeat's value in run order), the targets and a markdown table."""
    header = (
        f"{'contender':<17} {'step [s] median (per repeat)':<30} {'vs ddp':<30} {'vs hsdp':<30} "
        f"{'MB/node':>8} {'x fp32 bound':>12} {'others':>6}"
    )
    rows, md = [], []
    for name, s in summary.items():
        cells = [spread(s[k]) if finite(s[k]) else "n/a" for k in ("step_s", "vs_ddp", "vs_hsdp")]
        mb, xb = statistics.median(s["node_mb"]), statistics.median(s["bytes_x_bound"])
        others = statistics.median(finite(s["other_cores"]) or [float("nan")])
        rows.append(f"{name:<17} {cells[0]:<30} {cells[1]:<30} {cells[2]:<30} {mb:>8.2f} {xb:>12.3f} "
                    f"{report.fmt(others):>6}")  # fmt: skip
        md.append([f"`{name}`", *cells, f"{mb:.2f}", f"{xb:.3f}", report.fmt(others)])
    print(f"\n=== over {repeats} repeat(s): medians, each repeat's value in brackets")
    print(report.text_table(header, rows))
    print("\ntargets:")
    for name, (step_target, bytes_target) in TARGETS.items():
        if name not in summary:
            continue
        s = summary[name]
        vs_ddp, vs_hsdp = finite(s["vs_ddp"]), finite(s["vs_hsdp"])
        step = statistics.median(vs_ddp) if vs_ddp else float("nan")
        worst = max(s["bytes_x_bound"])
        ahead = (all(v < 1 for v in vs_hsdp) and len(vs_hsdp) == len(s["vs_hsdp"])) if vs_hsdp else None
        print(
            f"  {name}: step {report.fmt(step, '.3f')} x ddp (median; target <= {step_target}) -> "
            f"{verdict(step <= step_target if step == step else None)}; bytes {worst:.3f} x fp32 bound "
            f"(worst node and repeat; target <= {bytes_target}) -> {verdict(worst <= bytes_target)}; "
            f"ahead of hsdp in every repeat -> {verdict(ahead)}"
        )
    for name in (n for n in summary if is_bsp(n) and n != BSP):
        vs_bsp = finite(summary[name]["vs_bsp"])
        if vs_bsp:
            pays = all(v < 1 for v in vs_bsp) and len(vs_bsp) == len(summary[name]["vs_bsp"])
            print(
                f"  {name}: mean step {spread(vs_bsp)} x {BSP}'s (median, per repeat); it pays where below 1 "
                f"in every repeat -> {verdict(pays)}"
            )
    md_header = ["contender", "step [s]", "vs `ddp`", "vs HSDP", "MB/node/step", "x fp32 bound", "others"]
    print("\nmarkdown:\n" + report.md_table(md_header, md, tight_rule=False))


def main(argv: list[str] | None = None) -> int:
    """Run the contenders on one emulated cluster, interleaved, and report; returns the exit code."""
    run_options = cli.RUN_OPTIONS.format(timeout=600, per="contender run", logs="the per-run temp dir")
    p = cli.parser(__doc__, OPTIONS, run_options)
    args = p.parse_args(argv)
    args.contenders = DEFAULT_CONTENDERS if args.contenders == "default" else cli.comma_list(args.contenders)
    if args.inter_node_dtype:
        args.contenders = [REFERENCE, HSDP, f"hier_sliced_{args.inter_node_dtype}"]
    if not args.contenders or not set(args.contenders) <= set(CONTENDERS):
        p.error(f"--contenders: choose from {', '.join(CONTENDERS)}")

    def run_all(cluster: EmulatedCluster) -> bool:
        repeats: list[list[Run]] = []
        agree = True
        for repeat in range(args.repeats):
            if args.repeats > 1:
                print(f"\n=== repeat {repeat + 1} of {args.repeats}", flush=True)
            # each repeat starts one contender later, so a slow stretch of the host falls on each in turn
            k = repeat % len(args.contenders)
            order = args.contenders[k:] + args.contenders[:k]
            ports = (BASE_PORT + 10 * repeat + i for i in range(len(order)))
            results = [run_contender(cluster, args, name, port) for name, port in zip(order, ports)]
            results.sort(key=lambda r: args.contenders.index(r.strategy))
            repeats.append(results)
            agree = print_repeat(args, cluster, results) and agree
        summary = summarize(args.contenders, repeats)
        print_summary(summary, args.repeats)
        payload = {"config": report.config(args), "summary": summary, "first_losses_agree": agree}
        payload["repeats"] = [[asdict(r) for r in results] for results in repeats]
        report.save_json(args.json_out, lambda: payload)
        return agree and all(r.ok for results in repeats for r in results)

    return run_on_cluster(run_all, num_nodes=2, rate_mbit=args.rate_mbit)


if __name__ == "__main__":
    sys.exit(main())
