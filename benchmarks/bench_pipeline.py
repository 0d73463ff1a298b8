"""Throughput of ``hier_pipeline`` rebalanced vs its uniform split and ``torch.distributed.pipelining``.

A skewed model, 16 residual MLP blocks of width 256 whose first 8 are heavy (hidden 1024) and last 8
light (32, 16), trains on P CPU stage processes (``_pipeline_worker.py``): P = 2 is one process per
core (pinned), P = 4 puts two on each core, so its stage times include waiting for a core. For every
P one ``torch.distributed.run --standalone`` job per contender, same data, weights, micro-batches,
1F1B and SGD: ``rebalanced`` (the contender: ``HierPipelineStrategy(rebalance=N)``, measured from the
first check that leaves the split unchanged) against ``uniform`` (its uniform split, never
rebalanced), ``pipelining`` (``PipelineStage`` + ``Schedule1F1B`` on the same split) and
``pipelining_hier_split`` (the same on the split ``rebalanced`` ended with). Printed per P: samples/s,
rebalanced / uniform (target >= 1.5 for P = 2) and / pipelining, stage-time max/mean before and after
rebalancing (target <= 1.15 for P = 2) and the migration pause; repeats run interleaved, throughput
is their mean. Writes JSON and a PNG figure to ``benchmarks/results/``. Details:
benchmarks/README.md. Needs no root::

    python benchmarks/bench_pipeline.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from harness import cli, jobs, report
from harness.jobs import BUSY_HOST_CORES
from harness.report import fmt

WORKER = jobs.BENCH_DIR / "_pipeline_worker.py"
CONTENDERS = ("uniform", "rebalanced", "pipelining", "pipelining_hier_split")
LABELS = {
    "uniform": "hier_pipeline, uniform split",
    "rebalanced": "hier_pipeline, rebalanced",
    "pipelining": "torch pipelining, uniform split",
    "pipelining_hier_split": "torch pipelining, hier's final split",
}
TARGET_SPEEDUP = 1.5
TARGET_MAX_MEAN = 1.15
OPTIONS = """
--stages              str            2,4   comma-separated numbers of stage processes
--steps               int            12    measured steps per job
--warmup              int            4     steps before the window (uniform, pipelining)
--rebalance-every     int            4     rebalanced: check every N steps
--max-settle-steps    int            40    rebalanced: start measuring by then
--imbalance-threshold float          0.1   HierPipelineStrategy setting
--micro-batches       int            16
--batch-size          int            1024  samples per step
--schedule            {1f1b,gpipe}   1f1b
--width               int            256   what every block takes and returns
--heavy-hidden        int            1024  hidden width of the 8 heavy blocks
--light-hidden        str            32,16 hidden widths of the 8 light blocks (last repeats)
--pin {auto,on,off} auto pin rank r (all its threads) to core r mod cores; auto: only when P <= cores
--contenders          str  uniform,rebalanced,pipelining,pipelining_hier_split  comma-separated subset
--repeats             int            2     jobs per contender (interleaved); mean reported
--quick               flag           -     smoke run: P=2 only, one repeat, 8 steps
--wait-idle           float          0     before each job wait up to S s for an idle host
--retry-busy          int            0     rerun a disturbed job up to N times
"""
LAST_OPTIONS = """
--timeout   float  300  seconds allowed per job
--keep-logs flag   -    keep each job's temp dir (/tmp/lhbench-pipe-*)
"""
WORKER_OPTIONS = (
    "schedule", "width", "heavy_hidden", "light_hidden", "batch_size", "micro_batches", "warmup", "steps",
    "max_settle_steps", "imbalance_threshold",
)  # fmt: skip


# ---------------------------------------------------------------------- results
def max_over_mean(times: list[float]) -> float:
    return max(times) / (sum(times) / len(times)) if times and sum(times) > 0 else float("nan")


@dataclass
class Job:
    """One torchrun job (a contender at one P); ``worker`` is rank 0's JSON."""

    contender: str
    stages: int
    ok: bool
    error: str = ""
    wall_s: float = 0.0
    attempts: int = 1
    worker: dict[str, Any] = field(default_factory=dict)

    @property
    def samples_per_s(self) -> float:
        return float(self.worker["samples_per_s"])

    @property
    def step_ms(self) -> float:
        return 1e3 * float(self.worker["window_s"]) / int(self.worker["steps"])

    @property
    def other_cores(self) -> float:
        return float(self.worker.get("other_cores") or 0.0)

    @property
    def disturbed(self) -> bool:
        return self.other_cores > BUSY_HOST_CORES

    @property
    def split(self) -> list[int]:
        """Blocks per stage."""
        starts = list(self.worker["final_starts"])
        ends = starts[1:] + [len(self.worker["hiddens"])]
        return [b - a for a, b in zip(starts, ends)]

    @property
    def history(self) -> list[dict[str, Any]]:
        return list(self.worker.get("history") or [])

    @property
    def max_mean_window(self) -> float:
        """max/mean of the stage times measured in the window (hier jobs)."""
        times = self.worker.get("stage_times_s")
        return max_over_mean(times) if times else float("nan")

    @property
    def max_mean_before(self) -> float:
        """max/mean of the stage times the first rebalance measured (under the uniform split)."""
        return max_over_mean(self.history[0]["stage_times"]) if self.history else float("nan")

    @property
    def max_mean_predicted(self) -> float:
        return max_over_mean(self.history[-1]["predicted_times"]) if self.history else float("nan")

    @property
    def pauses_s(self) -> list[float]:
        return [float(e["pause_seconds"]) for e in self.history]

    def step_excess_s(self) -> list[float]:
        """Per rebalance: how much longer its step took (rank 0, start to start) than the median step
        since the previous rebalance (the first step, which warms up, left out)."""
        steps = self.worker.get("all_step_times_s") or []
        out = []
        previous = 1
        for event in self.history:
            k = int(event["step"]) - 1  # batch index of the step whose optimizer_step rebalanced
            before = steps[previous:k]
            if 0 <= k < len(steps) and before:
                out.append(steps[k] - statistics.median(before))
            else:
                out.append(float("nan"))
            previous = k + 1
        return out


def mean(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.fmean(values) if values else float("nan")


@dataclass
class Setup:
    """All jobs of one P (``jobs[contender]`` holds one job per repeat)."""

    stages: int
    jobs: dict[str, list[Job]] = field(default_factory=dict)

    def ok_jobs(self, contender: str) -> list[Job]:
        return [j for j in self.jobs.get(contender, []) if j.ok]

    def throughput(self, contender: str) -> float:
        return mean([j.samples_per_s for j in self.ok_jobs(contender)])

    def ratio(self, a: str, b: str) -> float:
        return self.throughput(a) / self.throughput(b)

    def paired_ratios(self, a: str, b: str) -> list[float]:
        """``a / b`` of each repeat (jobs of one repeat ran one after the other)."""
        pairs = zip(self.jobs.get(a, []), self.jobs.get(b, []))
        return [x.samples_per_s / y.samples_per_s for x, y in pairs if x.ok and y.ok]

    @property
    def label(self) -> str:
        cores = os.cpu_count() or 1
        if self.stages <= cores:
            return f"{self.stages} stages on {cores} cores"
        return f"{self.stages} stages on {cores} cores: stage times include waiting for a core"


# ---------------------------------------------------------------------- jobs
def worker_argv(
    args: argparse.Namespace, stages: int, contender: str, split: list[int] | None, workdir: Path
) -> list[str]:
    """The worker's command line: the shared settings, pinning, and what the contender runs."""
    argv = jobs.flags(**jobs.pick(args, *WORKER_OPTIONS), out=workdir / "rank0.json", pid_dir=workdir)
    if args.pin == "on" or (args.pin == "auto" and stages <= (os.cpu_count() or 1)):
        argv.append("--pin")
    if contender == "uniform":
        return argv + jobs.flags(mode="hier", rebalance="never")
    if contender == "rebalanced":
        return argv + jobs.flags(mode="hier", rebalance=args.rebalance_every)
    assert split is not None
    return argv + jobs.flags(mode="pipelining", split=",".join(str(s) for s in split))


def run_job(args: argparse.Namespace, stages: int, contender: str, split: list[int] | None) -> Job:
    """One torchrun job (the driver waits without polling: its CPU would count as other processes')."""
    with jobs.job_dir(f"lhbench-pipe-{contender}-{stages}-", args.keep_logs, show=True) as workdir:
        t0 = time.monotonic()
        with jobs.torchrun(
            stages, WORKER, worker_argv(args, stages, contender, split, workdir), workdir
        ) as proc:
            try:
                jobs.check_exit(proc.wait(timeout=args.timeout))
                worker = json.loads((workdir / "rank0.json").read_text())
                return Job(contender, stages, ok=True, wall_s=time.monotonic() - t0, worker=worker)
            except Exception as exc:  # report and go on with the next job
                return Job(contender, stages, ok=False, error=f"{exc}\n{jobs.tail(workdir / 'job.log')}")


def run_contender(args: argparse.Namespace, stages: int, contender: str, split: list[int] | None) -> Job:
    """``run_job`` after ``--wait-idle``; rerun up to ``--retry-busy`` times while others used the CPU."""
    attempt = lambda n: replace(run_job(args, stages, contender, split), attempts=n)
    note = "    disturbed: other processes used {:.2f} cores"
    return jobs.run_until_quiet(attempt, args.retry_busy, args.wait_idle, note, note_last=True)


def describe_job(job: Job) -> str:
    """One line about a finished job."""
    if not job.ok:
        return "FAILED: " + job.error.strip().splitlines()[0] if job.error.strip() else "FAILED"
    w = job.worker
    text = (
        f"{job.samples_per_s:,.0f} samples/s ({job.step_ms:.0f} ms/step), split {job.split}, "
        f"other processes {job.other_cores:.2f} cores, job {job.wall_s:.0f} s"
    )
    if job.contender == "rebalanced":
        text += (
            f", {len(job.history)} rebalance(s), window from step {w['window_start_step']}"
            f"{'' if w.get('settled') else ' (NOT settled)'}"
        )
    return text


def uniform_split(blocks: int, stages: int) -> list[int]:
    """First block of each stage under equal block counts (what ``partition="uniform"`` gives here)."""
    return [round(s * blocks / stages) for s in range(stages)]


# ---------------------------------------------------------------------- report
def detail_row(setup: Setup, contender: str) -> list[str] | None:
    """One row of the detail table (None when the contender did not run at this P)."""
    done = setup.ok_jobs(contender)
    if not done:
        return (
            [f"P={setup.stages}", LABELS[contender], "failed", *[""] * 5]
            if setup.jobs.get(contender)
            else None
        )
    rates = [j.samples_per_s for j in done]
    rate = f"{mean(rates):,.0f}" + (f" ({min(rates):,.0f}-{max(rates):,.0f})" if len(rates) > 1 else "")
    max_mean = (
        fmt(mean([j.max_mean_window for j in done])) if contender in ("uniform", "rebalanced") else "n/a"
    )
    splits = ", ".join(sorted({" ".join(map(str, j.split)) for j in done}))
    step_ms, vs_uniform = f"{mean([j.step_ms for j in done]):.0f}", fmt(setup.ratio(contender, "uniform"))
    other = f"{max(j.other_cores for j in done):.2f}"
    return [f"P={setup.stages}", LABELS[contender], splits, rate, step_ms, vs_uniform, max_mean, other]


def detail_table(setups: list[Setup]) -> str:
    """Every contender at every P."""
    header = [
        "setup",
        "contender",
        "blocks per stage",
        "samples/s",
        "step [ms]",
        "vs uniform",
        "stage max/mean",
    ]
    rows = [detail_row(setup, contender) for setup in setups for contender in CONTENDERS]
    return report.md_table([*header, "other cores"], [row for row in rows if row is not None])


def summary_table(setups: list[Setup]) -> str:
    """Per P: the throughputs, the ratios, the stage-time balance before and after, the migration pause."""
    rows = []
    for setup in setups:
        reb = setup.ok_jobs("rebalanced")
        pauses = [sum(j.pauses_s) * 1e3 for j in reb]
        rates = [fmt(setup.throughput(c), ",.0f") for c in ("uniform", "rebalanced", "pipelining")]
        ratios = [fmt(setup.ratio("rebalanced", c)) for c in ("uniform", "pipelining")]
        max_mean = [fmt(mean([j.max_mean_before for j in reb])), fmt(mean([j.max_mean_window for j in reb]))]
        rows.append([setup.label, *rates, *ratios, *max_mean, fmt(mean(pauses), ".0f")])
    rates = [f"{c} [samples/s]" for c in ("uniform", "rebalanced", "pipelining")]
    ratios = ["rebalanced / uniform", "rebalanced / pipelining", "max/mean before", "max/mean after"]
    return report.md_table(["setup", *rates, *ratios, "migration pause [ms]"], rows)


def rebalance_details(setups: list[Setup]) -> str:
    """Every rebalance of every rebalanced job, and what the checks in its window saw."""
    lines = []
    for setup in setups:
        for i, job in enumerate(setup.ok_jobs("rebalanced")):
            excess = job.step_excess_s()
            for k, event in enumerate(job.history):
                moved = sum(len(r["layers"]) for r in event["migration"]) // 2  # each is sent and received
                sent = sum(int(r["bytes_sent"]) for r in event["migration"])
                before = [round(t * 1e3, 1) for t in event["stage_times"]]
                after = [round(t * 1e3, 1) for t in event["predicted_times"]]
                extra = ""
                if excess[k] == excess[k]:
                    extra = f", that step took {excess[k] * 1e3:+.0f} ms vs the median step before"
                pause = event["pause_seconds"] * 1e3
                lines.append(
                    f"  P={setup.stages} run {i + 1} step {event['step']}: starts {event['old']['starts']} "
                    f"-> {event['new']['starts']}, stage ms/micro-batch {before} -> predicted {after}, "
                    f"{moved} layer(s) with state moved, {sent / 2**20:.1f} MiB, pause {pause:.0f} ms{extra}"
                )
            checks = job.worker.get("window_checks") or []
            measured = [round(t * 1e3, 1) for t in job.worker.get("stage_times_s") or []]
            lines.append(
                f"  P={setup.stages} run {i + 1} window: {len(checks)} check(s), "
                f"{sum(c['changed'] for c in checks)} changed the split; stage ms/micro-batch {measured} "
                f"(max/mean {fmt(job.max_mean_window)}, predicted {fmt(job.max_mean_predicted)})"
            )
    return "\n".join(lines)


def targets(setups: list[Setup]) -> str:
    """Per P: rebalanced / uniform and the stage balance after, against the targets."""
    lines = []
    for setup in setups:
        speedup = setup.ratio("rebalanced", "uniform")
        after = mean([j.max_mean_window for j in setup.ok_jobs("rebalanced")])
        note = "" if setup.stages <= (os.cpu_count() or 1) else " (targets are for one stage per core)"
        per_repeat = ", ".join(f"{r:.2f}" for r in setup.paired_ratios("rebalanced", "uniform"))
        lines.append(
            f"{setup.label}: rebalanced / uniform = {fmt(speedup)} [per repeat: {per_repeat}] "
            f"(target >= {TARGET_SPEEDUP}: "
            f"{'met' if speedup >= TARGET_SPEEDUP else 'NOT met'}), max/mean after = {fmt(after)} "
            f"(target <= {TARGET_MAX_MEAN}: {'met' if after <= TARGET_MAX_MEAN else 'NOT met'}){note}"
        )
    return "\n".join(lines)


def draw_throughput(ax: Any, setups: list[Setup]) -> None:
    """Samples/s of every contender, grouped by P."""
    width = 0.8 / len(CONTENDERS)
    for c, contender in enumerate(CONTENDERS):
        xs = [i + (c - (len(CONTENDERS) - 1) / 2) * width for i in range(len(setups))]
        bars = ax.bar(xs, [s.throughput(contender) for s in setups], width=width, label=LABELS[contender])
        ax.bar_label(bars, fmt="%.0f", fontsize=6)
    ax.set_xticks(range(len(setups)))
    waits = [s.stages > (os.cpu_count() or 1) for s in setups]
    ax.set_xticklabels(
        [f"P={s.stages}" + ("\n(waits for a core)" if w else "") for s, w in zip(setups, waits)]
    )
    top = max((s.throughput(c) for s in setups for c in CONTENDERS if s.ok_jobs(c)), default=1.0)
    ax.set_ylim(0, top * 1.45)
    ax.set_ylabel("samples/s")
    ax.set_title(f"throughput ({os.cpu_count()} cores)")
    ax.legend(fontsize=7, loc="upper left")


def draw_stage_times(ax: Any, setup: Setup) -> None:
    """Stage times of the first rebalanced job: under the uniform split and rebalanced."""
    reb = setup.ok_jobs("rebalanced")
    if not reb or not reb[0].history:
        ax.set_visible(False)
        return
    job = reb[0]
    before = [t * 1e3 for t in job.history[0]["stage_times"]]
    after = [t * 1e3 for t in job.worker["stage_times_s"]]
    xs = range(len(before))
    ax.bar(
        [x - 0.2 for x in xs], before, width=0.4, label=f"uniform split (max/mean {job.max_mean_before:.2f})"
    )
    ax.bar([x + 0.2 for x in xs], after, width=0.4, label=f"rebalanced (max/mean {job.max_mean_window:.2f})")
    ax.set_xticks(list(xs))
    ax.set_xlabel("stage")
    ax.set_ylabel("ms per micro-batch")
    title = f"stage times, {setup.stages} stages on {os.cpu_count()} cores"
    if setup.stages > (os.cpu_count() or 1):
        title += "\n(include waiting for a core)"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def draw(plt: Any, setups: list[Setup]) -> Any:
    """Throughput per P, and per P the stage times before and after rebalancing."""
    fig, axes = plt.subplots(1, 1 + len(setups), figsize=(5 + 3.6 * len(setups), 3.8), squeeze=False)
    draw_throughput(axes[0][0], setups)
    for ax, setup in zip(axes[0][1:], setups):
        draw_stage_times(ax, setup)
    return fig


def payload(args: argparse.Namespace, setups: list[Setup]) -> dict[str, Any]:
    """Everything as JSON: options, host, and per P the throughputs, ratios and every job."""
    host = {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    return {"config": report.config(args), "host": host, "setups": [setup_json(s) for s in setups]}


def setup_json(s: Setup) -> dict[str, Any]:
    """One P as JSON."""
    return {
        "stages": s.stages,
        "label": s.label,
        "samples_per_s": {c: s.throughput(c) for c in CONTENDERS if s.ok_jobs(c)},
        "rebalanced_vs_uniform": s.ratio("rebalanced", "uniform"),
        "rebalanced_vs_pipelining": s.ratio("rebalanced", "pipelining"),
        "jobs": {c: [asdict(j) for j in js] for c, js in s.jobs.items()},
    }


def print_report(args: argparse.Namespace, setups: list[Setup], started: float) -> None:
    """Print the settings, both tables, the rebalances, the targets, the losses and what failed; write
    JSON and (unless ``--no-figure``) the figure."""
    print()
    print(
        f"model: 16 residual MLP blocks of width {args.width}, hidden widths {args.hiddens}; batch "
        f"{args.batch_size} = {args.micro_batches} micro-batches, "
        f"schedule {args.schedule}, SGD; rebalance check every {args.rebalance_every} steps; "
        f"{args.steps} measured steps; {os.cpu_count()} cores"
    )
    print()
    print(summary_table(setups))
    print()
    print(detail_table(setups))
    print()
    print("rebalances:")
    print(rebalance_details(setups) or "  none")
    print()
    print(targets(setups))
    for setup in setups:
        losses = sorted({f"{j.worker['first_loss']:.6f}" for js in setup.jobs.values() for j in js if j.ok})
        same = "the same in every job" if len(losses) == 1 else "DIFFERS between jobs"
        print(f"P={setup.stages}: first-step loss {', '.join(losses)} ({same}: same weights and data)")
    disturbed = [j for s in setups for js in s.jobs.values() for j in js if j.ok and j.disturbed]
    if disturbed:
        print(
            f"WARNING: {len(disturbed)} job(s) ran while other processes used > {BUSY_HOST_CORES} cores "
            "(see 'other cores'); use --wait-idle / --retry-busy on a shared host."
        )
    failed = [j for s in setups for js in s.jobs.values() for j in js if not j.ok]
    report.print_failures([(f"P={j.stages} {j.contender}", j.error) for j in failed])
    print(f"\nbenchmark took {time.monotonic() - started:.0f} s")
    report.write_json(args.json_out, payload(args, setups), make_dir=True)
    print(f"wrote {args.json_out}")
    if args.figure is not None and report.save_figure(args.figure, lambda plt: draw(plt, setups), dpi=110):
        print(f"wrote {args.figure}")
    elif args.figure is not None:
        print("matplotlib is not installed: no figure (pip install matplotlib)")


# ---------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of the driver (``--quick`` overrides some of it)."""
    p = cli.parser(__doc__, OPTIONS)
    p.add_argument("--json-out", type=Path, default=jobs.RESULTS_DIR / "bench_pipeline.json")
    p.add_argument("--figure", type=Path, default=jobs.RESULTS_DIR / "bench_pipeline.png")
    p.add_argument("--no-figure", dest="figure", action="store_const", const=None)
    cli.add_options(p, LAST_OPTIONS)
    args = p.parse_args(argv)
    if args.quick:
        args.stages, args.steps, args.warmup, args.repeats = "2", 8, 3, 1
        args.rebalance_every, args.max_settle_steps = 4, 24
    args.stage_counts = [int(s) for s in args.stages.split(",")]
    args.contender_list = [c for c in args.contenders.split(",") if c]
    unknown = set(args.contender_list) - set(CONTENDERS)
    if unknown:
        p.error(f"unknown contenders {sorted(unknown)}; choose from {list(CONTENDERS)}")
    light = [int(w) for w in args.light_hidden.split(",")]
    args.hiddens = [args.heavy_hidden] * 8 + [light[min(i, len(light) - 1)] for i in range(8)]
    return args


def run_setup(args: argparse.Namespace, setup: Setup, repeat: int) -> None:
    """One repeat of every contender at one P; the torch contenders get the splits the hier jobs chose."""
    split, hier_split = uniform_split(16, setup.stages), None
    for contender in args.contender_list:
        if contender == "pipelining_hier_split" and hier_split is None:
            print(f"[P={setup.stages}] {LABELS[contender]}: skipped (no rebalanced split)")
            continue
        print(f"[P={setup.stages}, run {repeat + 1}] {LABELS[contender]} ...", flush=True)
        job_split = hier_split if contender == "pipelining_hier_split" else split
        job = run_contender(args, setup.stages, contender, job_split)
        setup.jobs.setdefault(contender, []).append(job)
        print("    " + describe_job(job), flush=True)
        if contender == "rebalanced" and job.ok:
            hier_split = list(job.worker["final_starts"])
        if contender == "uniform" and job.ok:
            split = list(job.worker["final_starts"])  # the split hier_pipeline chose


def main(argv: list[str] | None = None) -> int:
    """Run every repeat of every setup, report (also after Ctrl-C), return an exit code."""
    args = parse_args(argv)
    started = time.monotonic()
    setups = [Setup(p) for p in args.stage_counts]
    interrupted = False
    try:
        for repeat in range(args.repeats):
            for setup in setups:
                run_setup(args, setup, repeat)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: reporting what ran", flush=True)
    print_report(args, setups, started)
    failed = any(not j.ok for s in setups for js in s.jobs.values() for j in js)
    return 1 if failed or interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
