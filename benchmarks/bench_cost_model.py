"""The cost model (``lightning_hier.plan``) against the emulated cluster: predicted vs measured per-step
communication time and bytes per node of ``ddp`` and ``hier_sliced``, per link rate and topology.

Needs root and iproute2. What it measures and how: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from statistics import fmean

import bench_hier_sliced  # its workload: the same MLP and options
from harness import cli, jobs, report
from harness.cluster import EmulatedCluster, StrategyRun, run_on_cluster, run_workers

sys.path.insert(0, str(jobs.REPO_ROOT))  # lightning_hier from this checkout, as the workers import it
from lightning_hier.plan import Cluster, calibrate_from_csv, plan  # noqa: E402
from lightning_hier.profiling.report import write_csv  # noqa: E402

WORKER = jobs.BENCH_DIR / "_hier_sliced_worker.py"
NAME_PREFIX, SUBNET_PREFIX, BASE_PORT, LR = "lhcm", "10.79.0", 29740, 1e-3
MODEL = {"ddp": "ddp (flat ring)", "hier_sliced": "hier_sliced"}  # the plan's estimate of each strategy
KINDS = {"ddp": ("world",), "hier_sliced": ("intra", "inter")}  # CommProfiler kinds carrying gradients
TARGETS = {"bytes_per_node": 0.15, "comm_s": 0.25}  # |predicted / measured - 1| at most
WORKLOAD = [[f"--{name}"] for name in ("steps", "warmup", "hidden", "layers", "batch-size", "bucket-cap-mb")]
NOTE = "  other processes used {:.2f} cores while measuring; retrying"
OPTIONS = """
--rates         str    100,400  link rates (Mbit/s out per node), comma-separated
--topologies    str    2x2,2x1  nodes x processes per node, comma-separated
--intra-gbs     float  1.5      model: intra-node bandwidth per process (GB/s; gloo over loopback)
--latency-us    float  100      model: latency per ring step (us)
--calibrate     flag   -        also predict with the model fitted to the first hier_sliced run's CSV
--figure        path   None     predicted vs measured figure (default benchmarks/results/cost_model.png)
"""


@dataclass
class Run(StrategyRun):
    """One (topology, rate, strategy): rank 0's JSON with every rank's CommProfiler rows, the nodes'
    ``tx_bytes`` at the window's edges, and what is predicted for it."""

    nodes: int = 2
    per_node: int = 1
    rate_mbit: float = 0.0
    tx_bytes: dict[str, list[int]] = field(default_factory=dict)
    other_cores: float = 0.0
    measured: dict[str, float] = field(default_factory=dict)
    predicted: dict[str, dict[str, float]] = field(default_factory=dict)  # "model" / "calibrated"

    @property
    def label(self) -> str:
        return f"{self.nodes}x{self.per_node} {self.rate_mbit:g} Mbit/s {self.strategy}"

    def window_rows(self) -> list[dict]:
        """The CommProfiler rows of the measured steps."""
        first = self.worker["warmup"]
        return [r for r in self.worker["comm_profile"] if first <= r["step"] < first + self.worker["steps"]]

    def measure(self) -> None:
        """Bytes per node and step from ``tx_bytes`` and from the profiler's wire bytes; communication time
        per step: the profiler's busy time of the gradient kinds, summed, averaged over ranks and steps."""
        steps, rows = self.worker["steps"], self.window_rows()
        tx = [(e - s) / steps for s, e in zip(self.tx_bytes["start"], self.tx_bytes["end"])]
        ranks = {r["rank"] for r in rows}
        mine = [r for r in rows if r["kind"] in KINDS[self.strategy]]
        cross = [r for r in mine if r["kind"] != "intra"]  # ddp: one ring hop per node crosses
        per_node = len(ranks) / self.nodes if self.strategy == "hier_sliced" else 1
        self.measured = {
            "bytes_per_node": fmean(tx),
            "profiler_bytes_per_node": sum(r["wire_bytes"] for r in cross) / steps / len(ranks) * per_node,
            "comm_s": sum(r["time_ms"] for r in mine) / 1e3 / steps / len(ranks),
            "step_s": self.step_s,
        }


def predict(run: Run, args: argparse.Namespace, calibration: object | None = None) -> dict[str, float]:
    """The plan's estimate for ``run``'s strategy on a cluster at its link rate. Calibrated: the fitted
    intra-node bandwidth and latency, and the fitted share of the nominal rate the link delivers."""
    rate = run.rate_mbit * 1e6 / 8
    cluster = Cluster(run.nodes, run.per_node, args.intra_gbs * 1e9, rate, args.latency_us * 1e-6)
    if calibration is not None:
        cal, cal_rate = calibration
        cluster = cal.apply(cluster)
        if cal.inter_bandwidth is not None:
            cluster = replace(cluster, inter_bandwidth=cal.inter_bandwidth / cal_rate * rate)
    grad_bytes = run.worker["grad_bytes"]
    estimate = plan(cluster, grad_bytes / 4, bucket_mb=args.bucket_cap_mb).by_name(MODEL[run.strategy])
    return {"bytes_per_node": estimate.inter_bytes_per_node, "comm_s": estimate.seconds}


def run_one(cluster: EmulatedCluster, args: argparse.Namespace, strategy: str, per_node: int, port: int,
            attempt: int) -> Run:  # fmt: skip
    """One strategy on ``per_node`` processes a node, CommProfiler on; ``tx_bytes`` read at the hand-overs."""
    run = Run(strategy, nodes=len(cluster.nodes), per_node=per_node, rate_mbit=cluster.rate_mbit)
    config = {"strategy": strategy, "strategy_options": {"bucket_cap_mb": args.bucket_cap_mb}, "lr": LR}
    config.update(record="handover", comm_profiler=True, **jobs.pick(args, *("hidden", "layers", "steps")))
    config.update(jobs.pick(args, "batch_size", "warmup"))
    argv = [sys.executable, str(WORKER), "--config", json.dumps(config)]
    read_tx = lambda phase: run.tx_bytes.update({phase: [cluster.tx_bytes(n) for n in cluster.nodes]})
    before = jobs.cpu_snapshot()
    try:
        name = f"{NAME_PREFIX}-{strategy}-{per_node}"
        run.worker = run_workers(cluster, argv, name, per_node, port + 10 * attempt, args, read_tx)
        run.measure()
    except Exception as exc:  # report it and go on
        run.ok, run.error = False, str(exc)
    run.other_cores = jobs.other_cores(before, jobs.cpu_snapshot())
    return run


def met(predicted: float, measured: float, key: str) -> bool:
    """Whether a prediction is within its target of the measurement."""
    return abs(predicted / measured - 1) <= TARGETS[key]


def ratio_cells(predicted: dict[str, float], measured: dict[str, float], key: str, scale: float) -> str:
    """``predicted measured ratio verdict`` for one quantity."""
    p, m = predicted[key], measured[key]
    ok = "yes" if met(p, m, key) else "NO"
    return f"{p * scale:>9.1f} {m * scale:>9.1f} {p / m:>6.2f} {ok:>3}"


def print_report(args: argparse.Namespace, results: list[Run], calibration: dict | None) -> None:
    """The table, the targets, the calibration, the failures; JSON and figure."""
    done = [r for r in results if r.ok]
    header = (
        f"{'topology, rate, strategy':<30} {'pred MB':>9} {'tx MB':>9} {'ratio':>6} ok  {'prof MB':>8} "
        f"{'pred ms':>9} {'meas ms':>9} {'ratio':>6} ok  {'step ms':>8} {'other CPU':>9}"
        + (f" {'cal ms':>9} {'meas ms':>9} {'ratio':>6} ok" if calibration else "")
    )
    rows = []
    for r in done:
        model = r.predicted["model"]
        line = f"{r.label:<30} {ratio_cells(model, r.measured, 'bytes_per_node', 1e-6)} "
        line += f"{r.measured['profiler_bytes_per_node'] / 1e6:>8.1f} "
        line += ratio_cells(model, r.measured, "comm_s", 1e3)
        line += f" {r.measured['step_s'] * 1e3:>8.0f} {r.other_cores:>9.2f}"
        if calibration:
            line += " " + ratio_cells(r.predicted["calibrated"], r.measured, "comm_s", 1e3)
        rows.append(line)
    model = f"intra {args.intra_gbs:g} GB/s per process, latency {args.latency_us:g} us per ring step"
    print(
        f"\nMLP {args.layers} x Linear({args.hidden}, {args.hidden}), batch {args.batch_size}/process, "
        f"warmup {args.warmup}, measured steps {args.steps}; model: inter-node bandwidth = link rate, {model}"
    )
    print(report.text_table(header, rows))
    for key, target in TARGETS.items():
        for which in (done[0].predicted if key == "comm_s" else ["model"]) if done else ():
            hits = sum(met(r.predicted[which][key], r.measured[key], key) for r in done)
            print(f"target {key} within {target:.0%} ({which}): met in {hits} of {len(done)} runs")
    if calibration:
        print(f"\ncalibrated from {calibration['source']} ({calibration['csv']}):\n{calibration['table']}")
    report.print_failures([(f"[{r.label}]", r.error) for r in results if not r.ok])
    for r in results:
        r.worker.pop("comm_profile", None)
    payload = {"config": report.config(args), "targets": TARGETS, "calibration": calibration}
    report.save_json(args.json_out, lambda: {**payload, "results": [asdict(r) for r in results]})
    if done and report.save_figure(args.figure, partial(draw, done, bool(calibration)), dpi=120):
        print(f"wrote {args.figure}")


def draw(runs: list[Run], calibrated: bool, plt: object) -> object:
    """Predicted vs measured bytes and time, one point per run, the target band around y = x."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
    units = {"bytes_per_node": (1e-6, "MB per node and step"), "comm_s": (1e3, "communication ms per step")}
    for ax, (key, (scale, unit)) in zip(axes, units.items()):
        kinds = [("model", "o")] + ([("calibrated", "x")] if calibrated else [])
        for which, marker in kinds:
            for r in runs:
                xy = (r.measured[key] * scale, r.predicted[which][key] * scale)
                ax.scatter(*xy, marker=marker, color="C0" if r.strategy == "ddp" else "C1")
                if which == "model":
                    ax.annotate(f"{r.nodes}x{r.per_node} {r.rate_mbit:g}", xy, fontsize=7)
        top = max(max(r.measured[key], *(p[key] for p in r.predicted.values())) for r in runs) * scale * 1.15
        band = TARGETS[key]
        ax.plot([0, top], [0, top], "k-", lw=0.8)
        ax.fill_between([0, top], [0, top * (1 - band)], [0, top * (1 + band)], color="grey", alpha=0.2)
        ax.set(xlim=(0, top), ylim=(0, top), xlabel=f"measured {unit}", ylabel=f"predicted {unit}")
        ax.set_title(f"{unit} (grey: within {band:.0%})", fontsize=9)
    marks = "o model, x calibrated" if calibrated else "o model"
    fig.suptitle(f"cost model, predicted vs measured (blue ddp, orange hier_sliced; {marks})", fontsize=10)
    return fig


def calibrate(results: list[Run], args: argparse.Namespace) -> dict | None:
    """Fit the model to the first hier_sliced run's CSV (written next to the JSON); predict again with it."""
    source = next((r for r in results if r.ok and r.strategy == "hier_sliced"), None)
    if source is None:
        print("--calibrate: no hier_sliced run to calibrate from")
        return None
    csv = write_csv(source.window_rows(), args.json_out.with_name(args.json_out.stem + "_calibration.csv"))
    cal = calibrate_from_csv(csv, latency=args.latency_us * 1e-6, devices_per_node=source.per_node)
    for r in results:
        if r.ok:
            r.predicted["calibrated"] = predict(r, args, (cal, source.rate_mbit * 1e6 / 8))
    given = Cluster(source.nodes, source.per_node, args.intra_gbs * 1e9, source.rate_mbit * 1e6 / 8,
                    args.latency_us * 1e-6)  # fmt: skip
    return {"source": source.label, "csv": str(csv), "table": cal.table(given), "fit": asdict(cal)}


def main(argv: list[str] | None = None) -> int:
    """Every (rate, topology, strategy) on its own emulated cluster; report; returns the exit code."""
    run_options = cli.RUN_OPTIONS.format(timeout=600, per="strategy run", logs="the per-run temp dir")
    workload = [line for line in bench_hier_sliced.OPTIONS.splitlines() if line.split()[:1] in WORKLOAD]
    p = cli.parser(__doc__, OPTIONS, "\n".join(workload), run_options, cli.IDLE_OPTIONS.format(job="run"))
    args = p.parse_args(argv)
    args.json_out = args.json_out or jobs.RESULTS_DIR / "cost_model.json"
    args.figure = args.figure or jobs.RESULTS_DIR / "cost_model.png"
    try:
        rates = [float(r) for r in cli.comma_list(args.rates)]
        shapes = [tuple(int(v) for v in t.split("x")) for t in cli.comma_list(args.topologies)]
    except ValueError:
        p.error("--rates: numbers; --topologies: NODESxPROCESSES, e.g. 2x2,2x1")
    if not rates or min(rates) <= 0 or not shapes or any(len(s) != 2 or s[0] < 2 or s[1] < 1 for s in shapes):
        p.error("--rates must be positive; --topologies NxL with N >= 2 nodes and L >= 1")
    results: list[Run] = []
    codes = []
    for nodes, per_node in shapes:
        for rate in rates:

            def body(cluster: EmulatedCluster, per_node: int = per_node) -> bool:
                for strategy in MODEL:
                    port = BASE_PORT + len(results) * 50
                    one = partial(run_one, cluster, args, strategy, per_node, port)
                    results.append(jobs.run_until_quiet(one, args.retry_busy, args.wait_idle, NOTE))
                return all(r.ok for r in results)

            options = {"num_nodes": nodes, "rate_mbit": rate, "subnet_prefix": SUBNET_PREFIX}
            codes.append(run_on_cluster(body, name_prefix=NAME_PREFIX, **options))
            if codes[-1] == 130:
                return 130
    for r in results:
        if r.ok:
            r.predicted["model"] = predict(r, args)
    print_report(args, results, calibrate(results, args) if args.calibrate else None)
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
