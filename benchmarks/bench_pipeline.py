"""Throughput of ``hier_pipeline`` rebalanced vs its uniform split and ``torch.distributed.pipelining``.

A skewed model, 16 residual MLP blocks of width 256 whose hidden layers have very different
widths: 1024 for the first 8 (heavy, together), 32 and 16 for the last 8 (see
``_pipeline_worker.py``), is trained on P CPU stage processes. P = 2 on a 2-core host is one
process per core (each pinned to its core); P = 4 puts two stage processes on each core (not
pinned), so measured stage times include waiting for a core. For every P, in one run, one
``torch.distributed.run --standalone`` job per contender, same data, weights, micro-batches
(``--micro-batches`` 16 of a 1024-sample batch), 1F1B and SGD:

* ``uniform``: ``HierPipelineStrategy(partition="uniform", rebalance="never")``, the uniform-count
  split (8 | 8 blocks for P = 2: all heavy blocks on stage 0);
* ``rebalanced``: ``HierPipelineStrategy(partition="uniform", rebalance=N)``: starts from the same
  split, measures per-layer times, repartitions and migrates layers live at every N-step check; it
  is measured from the first check that leaves the split unchanged;
* ``pipelining``: plain torch, ``torch.distributed.pipelining.PipelineStage`` + ``Schedule1F1B``
  over the same uniform-count split (a static split: ``torch.distributed.pipelining`` has no
  automatic balancing);
* ``pipelining_hier_split``: the same, with the split the ``rebalanced`` job ended with, given by
  hand (what that split is worth without ``hier_pipeline``'s engine and Lightning).

Reported per P: samples/s over the measured window (rank 0, barrier to barrier), the ratios
rebalanced / uniform (target >= 1.5 for P = 2) and rebalanced / pipelining, stage-time max/mean
before rebalancing (the stage times the first rebalance measured) and after (those measured by
the checks inside the window; target <= 1.15 for P = 2), and the migration pause. Repeats run
interleaved; throughput is the mean over them. Writes JSON and a PNG figure to
``benchmarks/results/``. Needs no root::

    python benchmarks/bench_pipeline.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
WORKER = HERE / "_pipeline_worker.py"
RESULTS_DIR = HERE / "results"
CONTENDERS = ("uniform", "rebalanced", "pipelining", "pipelining_hier_split")
LABELS = {
    "uniform": "hier_pipeline, uniform split",
    "rebalanced": "hier_pipeline, rebalanced",
    "pipelining": "torch pipelining, uniform split",
    "pipelining_hier_split": "torch pipelining, hier's final split",
}
TARGET_SPEEDUP = 1.5
TARGET_MAX_MEAN = 1.15
BUSY_HOST_CORES = 0.2  # CPU use of other processes (cores) above which a job counts as disturbed


# ---------------------------------------------------------------------- host load
def cpu_snapshot() -> tuple[float, float, float]:
    """``(wall, host busy CPU seconds, CPU seconds of this driver and its reaped children)``."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    busy = (fields[0] + fields[1] + fields[2]) / os.sysconf("SC_CLK_TCK")
    ours = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        ours += usage.ru_utime + usage.ru_stime
    return time.monotonic(), busy, ours


def wait_idle(timeout_s: float, sample_s: float = 2.0) -> float:
    """Wait (up to ``timeout_s``) until other processes use less than ``BUSY_HOST_CORES``; returns
    the last sampled use in cores."""
    deadline = time.monotonic() + timeout_s
    while True:
        before = cpu_snapshot()
        time.sleep(sample_s)
        after = cpu_snapshot()
        other = max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / max(after[0] - before[0], 1e-9)
        if other <= BUSY_HOST_CORES or time.monotonic() >= deadline:
            return other
        print(f"  host busy ({other:.2f} cores used by other processes), waiting ...", flush=True)


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
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(stages),
        str(WORKER),
        "--schedule",
        args.schedule,
        "--width",
        str(args.width),
        "--heavy-hidden",
        str(args.heavy_hidden),
        "--light-hidden",
        args.light_hidden,
        "--batch-size",
        str(args.batch_size),
        "--micro-batches",
        str(args.micro_batches),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--max-settle-steps",
        str(args.max_settle_steps),
        "--imbalance-threshold",
        str(args.imbalance_threshold),
        "--out",
        str(workdir / "rank0.json"),
        "--pid-dir",
        str(workdir),
    ]
    if args.pin == "on" or (args.pin == "auto" and stages <= (os.cpu_count() or 1)):
        argv.append("--pin")
    if contender == "uniform":
        argv += ["--mode", "hier", "--rebalance", "never"]
    elif contender == "rebalanced":
        argv += ["--mode", "hier", "--rebalance", str(args.rebalance_every)]
    else:
        assert split is not None
        argv += ["--mode", "pipelining", "--split", ",".join(str(s) for s in split)]
    return argv


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def live_workers(workdir: Path, nproc: int) -> list[int]:
    """Pids of this job's workers that still run (checked by command line: pids can be reused)."""
    pids = []
    for rank in range(nproc):
        with contextlib.suppress(OSError, ValueError):
            pid = int((workdir / f"pid.{rank}").read_text())
            if str(workdir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
    return pids


def stop_job(proc: subprocess.Popen[bytes], workdir: Path, nproc: int, grace_s: float = 5.0) -> None:
    """Stop what this job started, by id: the launcher's process group and its workers."""

    def signal_workers(sig: int) -> None:
        for pid in live_workers(workdir, nproc):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    if proc.poll() is None:  # not reaped yet, so its process group id is still ours
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        signal_workers(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    signal_workers(signal.SIGKILL)  # normally none left: the launcher stops its workers


def log_tail(path: Path, lines: int = 30) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run_job(args: argparse.Namespace, stages: int, contender: str, split: list[int] | None) -> Job:
    workdir = Path(tempfile.mkdtemp(prefix=f"lhbench-pipe-{contender}-{stages}-"))
    t0 = time.monotonic()
    with open(workdir / "job.log", "wb") as log:
        proc = subprocess.Popen(
            worker_argv(args, stages, contender, split, workdir),
            env=worker_env(),
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        code = proc.wait(timeout=args.timeout)
        if code != 0:
            raise RuntimeError(f"torch.distributed.run exited with code {code}")
        worker = json.loads((workdir / "rank0.json").read_text())
        return Job(contender, stages, ok=True, wall_s=time.monotonic() - t0, worker=worker)
    except Exception as exc:  # report and go on with the next job
        return Job(contender, stages, ok=False, error=f"{exc}\n{log_tail(workdir / 'job.log')}")
    finally:
        stop_job(proc, workdir, stages)
        if args.keep_logs:
            print(f"    logs: {workdir}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def run_contender(args: argparse.Namespace, stages: int, contender: str, split: list[int] | None) -> Job:
    """``run_job`` after ``--wait-idle``; rerun up to ``--retry-busy`` times while others used the CPU."""
    best: Job | None = None
    for attempt in range(1, args.retry_busy + 2):
        if args.wait_idle > 0:
            wait_idle(args.wait_idle)
        job = run_job(args, stages, contender, split)
        job.attempts = attempt
        if not job.ok:
            return job
        if best is None or job.other_cores < best.other_cores:
            best = job
        if not job.disturbed:
            break
        print(f"    disturbed: other processes used {job.other_cores:.2f} cores", flush=True)
    assert best is not None
    return best


def describe_job(job: Job) -> str:
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
def fmt(value: float, spec: str = ".2f") -> str:
    return format(value, spec) if value == value else "n/a"


def detail_table(setups: list[Setup]) -> str:
    lines = [
        "| setup | contender | blocks per stage | samples/s | step [ms] | vs uniform | stage max/mean "
        "| other cores |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for setup in setups:
        for contender in CONTENDERS:
            jobs = setup.ok_jobs(contender)
            if not jobs:
                if setup.jobs.get(contender):
                    lines.append(f"| P={setup.stages} | {LABELS[contender]} | failed | | | | | |")
                continue
            rates = [j.samples_per_s for j in jobs]
            rate = f"{mean(rates):,.0f}"
            if len(rates) > 1:
                rate += f" ({min(rates):,.0f}-{max(rates):,.0f})"
            max_mean = "n/a"
            if contender in ("uniform", "rebalanced"):
                max_mean = fmt(mean([j.max_mean_window for j in jobs]))
            splits = sorted({" ".join(map(str, j.split)) for j in jobs})
            lines.append(
                f"| P={setup.stages} | {LABELS[contender]} | {', '.join(splits)} | {rate} | "
                f"{mean([j.step_ms for j in jobs]):.0f} | {fmt(setup.ratio(contender, 'uniform'))} | "
                f"{max_mean} | {max(j.other_cores for j in jobs):.2f} |"
            )
    return "\n".join(lines)


def summary_table(setups: list[Setup]) -> str:
    lines = [
        "| setup | uniform [samples/s] | rebalanced [samples/s] | pipelining [samples/s] "
        "| rebalanced / uniform | rebalanced / pipelining | max/mean before | max/mean after "
        "| migration pause [ms] |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for setup in setups:
        reb = setup.ok_jobs("rebalanced")
        pauses = [sum(j.pauses_s) * 1e3 for j in reb]
        rates = [fmt(setup.throughput(c), ",.0f") for c in ("uniform", "rebalanced", "pipelining")]
        ratios = [fmt(setup.ratio("rebalanced", c)) for c in ("uniform", "pipelining")]
        max_mean = [fmt(mean([j.max_mean_before for j in reb])), fmt(mean([j.max_mean_window for j in reb]))]
        cells = [setup.label, *rates, *ratios, *max_mean, fmt(mean(pauses), ".0f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rebalance_details(setups: list[Setup]) -> str:
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


def draw(setups: list[Setup], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 1 + len(setups), figsize=(5 + 3.6 * len(setups), 3.8), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / len(CONTENDERS)
    for c, contender in enumerate(CONTENDERS):
        xs = [i + (c - (len(CONTENDERS) - 1) / 2) * width for i in range(len(setups))]
        bars = ax.bar(xs, [s.throughput(contender) for s in setups], width=width, label=LABELS[contender])
        ax.bar_label(bars, fmt="%.0f", fontsize=6)
    ax.set_xticks(range(len(setups)))
    ax.set_xticklabels(
        [
            f"P={s.stages}" + ("" if s.stages <= (os.cpu_count() or 1) else "\n(waits for a core)")
            for s in setups
        ]
    )
    top = max((s.throughput(c) for s in setups for c in CONTENDERS if s.ok_jobs(c)), default=1.0)
    ax.set_ylim(0, top * 1.45)
    ax.set_ylabel("samples/s")
    ax.set_title(f"throughput ({os.cpu_count()} cores)")
    ax.legend(fontsize=7, loc="upper left")
    for ax, setup in zip(axes[0][1:], setups):
        reb = setup.ok_jobs("rebalanced")
        if not reb or not reb[0].history:
            ax.set_visible(False)
            continue
        job = reb[0]
        before = [t * 1e3 for t in job.history[0]["stage_times"]]
        after = [t * 1e3 for t in job.worker["stage_times_s"]]
        xs = range(len(before))
        ax.bar(
            [x - 0.2 for x in xs],
            before,
            width=0.4,
            label=f"uniform split (max/mean {job.max_mean_before:.2f})",
        )
        ax.bar(
            [x + 0.2 for x in xs], after, width=0.4, label=f"rebalanced (max/mean {job.max_mean_window:.2f})"
        )
        ax.set_xticks(list(xs))
        ax.set_xlabel("stage")
        ax.set_ylabel("ms per micro-batch")
        title = f"stage times, {setup.stages} stages on {os.cpu_count()} cores"
        if setup.stages > (os.cpu_count() or 1):
            title += "\n(include waiting for a core)"
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(args: argparse.Namespace, setups: list[Setup], started: float) -> None:
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
    for s in setups:
        for js in s.jobs.values():
            for j in js:
                if not j.ok:
                    print(f"\nP={s.stages} {j.contender} FAILED:\n{j.error}")
    print(f"\nbenchmark took {time.monotonic() - started:.0f} s")
    payload = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "host": {
            "cores": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "setups": [
            {
                "stages": s.stages,
                "label": s.label,
                "samples_per_s": {c: s.throughput(c) for c in CONTENDERS if s.ok_jobs(c)},
                "rebalanced_vs_uniform": s.ratio("rebalanced", "uniform"),
                "rebalanced_vs_pipelining": s.ratio("rebalanced", "pipelining"),
                "jobs": {c: [asdict(j) for j in js] for c, js in s.jobs.items()},
            }
            for s in setups
        ],
    }
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(payload, indent=2, default=str))
    print(f"wrote {args.json_out}")
    if args.figure is not None:
        try:
            draw(setups, args.figure)
            print(f"wrote {args.figure}")
        except ImportError:
            print("matplotlib is not installed: no figure (pip install matplotlib)")


# ---------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", default="2,4", help="comma-separated numbers of stage processes")
    p.add_argument("--steps", type=int, default=12, help="measured steps per job")
    p.add_argument("--warmup", type=int, default=4, help="steps before the window (uniform, pipelining)")
    p.add_argument("--rebalance-every", type=int, default=4, help="rebalanced: check every N steps")
    p.add_argument("--max-settle-steps", type=int, default=40, help="rebalanced: start measuring by then")
    p.add_argument("--imbalance-threshold", type=float, default=0.1, help="HierPipelineStrategy setting")
    p.add_argument("--micro-batches", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=1024, help="samples per step")
    p.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    p.add_argument("--width", type=int, default=256, help="what every block takes and returns")
    p.add_argument("--heavy-hidden", type=int, default=1024, help="hidden width of the 8 heavy blocks")
    p.add_argument(
        "--light-hidden", default="32,16", help="hidden widths of the 8 light blocks (last repeats)"
    )
    p.add_argument(
        "--pin",
        default="auto",
        choices=("auto", "on", "off"),
        help="pin rank r (all its threads) to core r mod cores; auto: only when P <= cores",
    )
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated subset")
    p.add_argument("--repeats", type=int, default=2, help="jobs per contender (interleaved); mean reported")
    p.add_argument("--quick", action="store_true", help="smoke run: P=2 only, one repeat, 8 steps")
    p.add_argument(
        "--wait-idle", type=float, default=0, help="before each job wait up to S s for an idle host"
    )
    p.add_argument("--retry-busy", type=int, default=0, help="rerun a disturbed job up to N times")
    p.add_argument("--json-out", type=Path, default=RESULTS_DIR / "bench_pipeline.json")
    p.add_argument("--figure", type=Path, default=RESULTS_DIR / "bench_pipeline.png")
    p.add_argument("--no-figure", dest="figure", action="store_const", const=None)
    p.add_argument("--timeout", type=float, default=300, help="seconds allowed per job")
    p.add_argument("--keep-logs", action="store_true", help="keep each job's temp dir (/tmp/lhbench-pipe-*)")
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    setups = [Setup(p) for p in args.stage_counts]
    interrupted = False
    try:
        for repeat in range(args.repeats):
            for setup in setups:
                split = uniform_split(16, setup.stages)
                hier_split: list[int] | None = None
                for contender in args.contender_list:
                    if contender == "pipelining_hier_split":
                        if hier_split is None:
                            print(f"[P={setup.stages}] {LABELS[contender]}: skipped (no rebalanced split)")
                            continue
                        job_split: list[int] | None = hier_split
                    else:
                        job_split = split
                    print(f"[P={setup.stages}, run {repeat + 1}] {LABELS[contender]} ...", flush=True)
                    job = run_contender(args, setup.stages, contender, job_split)
                    setup.jobs.setdefault(contender, []).append(job)
                    print("    " + describe_job(job), flush=True)
                    if contender == "rebalanced" and job.ok:
                        hier_split = list(job.worker["final_starts"])
                    if contender == "uniform" and job.ok:
                        split = list(job.worker["final_starts"])  # the split hier_pipeline chose
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: reporting what ran", flush=True)
    report(args, setups, started)
    failed = any(not j.ok for s in setups for js in s.jobs.values() for j in js)
    return 1 if failed or interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
