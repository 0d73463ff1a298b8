"""Memory and throughput of a >= 1 GB embedding table: ``HybridEmbedding`` vs ``nn.EmbeddingBag`` + ddp.

Four trainer processes on one host train a click-through-style model (``_hybrid_embedding_worker.py``)
whose table is ``--rows`` x ``--dim`` float32 (2,000,000 x 128 = 1.02 GB): ``hybrid`` (the contender,
``HybridEmbedding`` under ``HierSlicedStrategy``, one copy per node in ``/dev/shm``) against the
references ``ddp_sparse`` and ``ddp_dense`` (``nn.EmbeddingBag`` under ``ddp``); TorchRec is not run
(``TORCHREC_NOTE``). Each variant runs as one ``torch.distributed.run`` job with the big table and one
with a tiny table: the driver sums the workers' PSS (``/proc/<pid>/smaps_rollup``) in a memory window,
table memory = PSS(big) - PSS(tiny), then times ``--steps`` steps without sampling. Printed: memory,
samples/s and the ratios hybrid / ddp_sparse (table memory, target <= 0.30; throughput, target >= 1.0)
and hybrid / ddp_dense. Details: benchmarks/README.md. No root; Linux only::

    python benchmarks/bench_hybrid_embedding.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from harness import cli, jobs, report
from harness.jobs import BUSY_HOST_CORES, WITH_IRQ_AND_STEAL

WORKER = jobs.BENCH_DIR / "_hybrid_embedding_worker.py"
NPROC = 4
VARIANTS = ("hybrid", "ddp_dense", "ddp_sparse")
TARGET_MEMORY_RATIO = 0.30
TARGET_THROUGHPUT_RATIO = 1.0
PSS_FIELDS = ("Pss", "Pss_Anon", "Pss_Shmem", "Pss_File", "Rss")
PHASES = ("mem_start", "start", "end")
TORCHREC_NOTE = (
    "TorchRec: not available for torch 2.13 CPU (`pip install torchrec` resolves torchrec 1.9.2 with "
    "fbgemm-gpu 1.9.0, a CUDA build for torch 2.14 that needs libtorch_cuda.so, and downgrades torchmetrics "
    "to 1.0.3; the CPU pair for torch 2.13, torchrec 1.8.0 + fbgemm-gpu-cpu 1.8.0, installs only by hand "
    "with --no-deps, and TorchRec's sharded training (DistributedModelParallel) has no Lightning strategy)"
)
# rough peak bytes per process for the big table, as multiples of the table size (for the memory check)
TABLE_COPIES_PER_PROCESS = {"hybrid": 0.25, "ddp_dense": 3.2, "ddp_sparse": 1.2}
PROCESS_OVERHEAD_BYTES = 700 * 2**20
OPTIONS = """
--rows            int    2_000_000  rows of the big table
--tiny-rows       int    1000       rows of the tiny (baseline) table
--dim             int    128        embedding dimension (float32)
--batch-size      int    1024       samples per process and step
--max-bag         int    8          ids per sample: uniform in 1..max-bag
--zipf            float  1.05       power-law exponent of the id ranks
--warmup          int    3          warm-up steps before the memory window
--mem-steps       int    5          steps of the memory-sampling window
--steps           int    40         timed steps (after the memory window)
--dense-warmup    int    1          warm-up steps of ddp_dense (~5 s a step)
--dense-mem-steps int    1          memory-window steps of ddp_dense
--dense-steps     int    4          timed steps of ddp_dense
--repeats int 2 big-table jobs per variant (interleaved; throughput = their mean); ddp_dense runs once
--variants        str    hybrid,ddp_dense,ddp_sparse  comma-separated: hybrid, ddp_dense, ddp_sparse
--sample-interval float  0.2        seconds between PSS samples
"""
LAST_OPTIONS = """
--skip-memory-check flag - run even if MemAvailable looks short
"""


@dataclass
class JobResult:
    """One torchrun job: a variant with one table size."""

    variant: str
    rows: int
    ok: bool
    error: str = ""
    worker: dict[str, Any] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)  # summed smaps_rollup fields (bytes) at peak Pss
    per_process_pss: list[int] = field(default_factory=list)  # bytes, at the peak sample
    samples: int = 0
    other_cores: float = 0.0  # mean CPU use of processes outside this job during the timed window
    attempts: int = 1

    @property
    def pss(self) -> int:
        return self.peak["Pss"]


@dataclass
class VariantResult:
    """A variant's big-table jobs (``--repeats``, run interleaved with the other variants) and tiny job."""

    variant: str
    bigs: list[JobResult] = field(default_factory=list)
    tiny: JobResult | None = None

    @property
    def ok(self) -> bool:
        return bool(self.bigs) and all(b.ok for b in self.bigs) and self.tiny is not None and self.tiny.ok

    @property
    def big(self) -> JobResult:
        """The big-table job with the largest PSS (memory is the max over all samples of all repeats)."""
        return max(self.bigs, key=lambda b: b.pss)

    @property
    def table_memory(self) -> int:
        assert self.tiny is not None
        return self.big.pss - self.tiny.pss

    @property
    def throughputs(self) -> list[float]:
        return [float(b.worker["samples_per_s"]) for b in self.bigs]

    @property
    def samples_per_s(self) -> float:
        """Mean over the repeats."""
        return statistics.fmean(self.throughputs)

    @property
    def mean_step_s(self) -> float:
        return statistics.fmean(float(b.worker["mean_step_s"]) for b in self.bigs)

    @property
    def other_cores(self) -> float:
        return max(b.other_cores for b in self.bigs)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of the driver."""
    run_options = cli.RUN_OPTIONS.format(timeout=600, per="job", logs="the per-job temp dirs")
    p = cli.parser(__doc__, OPTIONS, run_options, cli.IDLE_OPTIONS.format(job="job"), LAST_OPTIONS)
    args = p.parse_args(argv)
    args.variants = cli.comma_list(args.variants)
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants: {sorted(unknown)} (choose from {', '.join(VARIANTS)})")
    return args


# ---------------------------------------------------------------------- memory
def read_rollup(pid: int) -> dict[str, int]:
    """The ``PSS_FIELDS`` of ``/proc/<pid>/smaps_rollup``, in bytes."""
    values: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            if key in PSS_FIELDS:
                values[key] = int(rest.split()[0]) * 1024
    return values


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes."""
    values = {}
    with open("/proc/meminfo") as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            values[key] = int(rest.split()[0]) * 1024
    return values


class PssSampler:
    """Sums the worker processes' smaps_rollup fields; keeps the sample with the largest total Pss."""

    def __init__(self) -> None:
        self.pids: list[int] = []  # set when the memory window starts
        self.samples = 0
        self.peak: dict[str, int] = {}
        self.per_process: list[int] = []

    def sample(self) -> None:
        try:
            rollups = [read_rollup(pid) for pid in self.pids]
        except (FileNotFoundError, ProcessLookupError):
            return  # a worker is exiting
        total = {k: sum(r.get(k, 0) for r in rollups) for k in PSS_FIELDS}
        self.samples += 1
        if total["Pss"] > self.peak.get("Pss", -1):
            self.peak = total
            self.per_process = [r["Pss"] for r in rollups]

    def found(self) -> dict[str, Any]:
        """What the samples found, as :class:`JobResult` fields."""
        return {"peak": self.peak, "per_process_pss": self.per_process, "samples": self.samples}


# ---------------------------------------------------------------------- jobs
def worker_argv(args: argparse.Namespace, variant: str, rows: int, workdir: Path) -> list[str]:
    """The worker's command line (``ddp_dense`` has its own step counts)."""
    prefix = "dense_" if variant == "ddp_dense" else ""
    steps = {k: getattr(args, prefix + k) for k in ("warmup", "mem_steps", "steps")}
    shape = jobs.pick(args, "dim", "batch_size", "max_bag", "zipf")
    return jobs.flags(
        variant=variant, rows=rows, **shape, **steps, signal_dir=workdir, out=workdir / "rank0.json"
    )


def worker_pids(workdir: Path) -> list[int]:
    """The pids the workers wrote at start-up."""
    files = [workdir / f"pid.{rank}" for rank in range(NPROC)]
    if not all(f.exists() for f in files):
        raise RuntimeError("the window started before every worker wrote its pid")
    return [int(f.read_text()) for f in files]


def serve(
    proc: subprocess.Popen[bytes], workdir: Path, interval: float, timeout_s: float
) -> tuple[PssSampler, float]:
    """Until the job exits: ack the windows' edges (a memory sample at each), sample memory
    between "mem_start" and "start", and leave the timed window ("start" to "end") alone.

    Returns the sampler and the mean CPU use (cores) of other processes during the timed window.
    """
    markers, sampler = jobs.Markers(workdir, PHASES), PssSampler()
    cpu: dict[str, jobs.Snapshot] = {}

    def at_edge(phase: str) -> None:
        sampler.pids = sampler.pids or worker_pids(workdir)
        sampler.sample()
        cpu[phase] = jobs.cpu_snapshot([proc.pid, *sampler.pids], WITH_IRQ_AND_STEAL)

    deadline = time.monotonic() + timeout_s
    next_sample = 0.0
    while True:
        markers.answer(at_edge)
        now = time.monotonic()
        if sampler.pids and "start" not in markers.acked and now >= next_sample:
            sampler.sample()
            next_sample = now + interval
        code = proc.poll()
        if code is not None:
            jobs.check_exit(code)
            if markers.missing:
                raise RuntimeError(f"the job finished without signalling {sorted(markers.missing)}")
            return sampler, jobs.other_cores(cpu["start"], cpu["end"])
        if now > deadline:
            raise TimeoutError(f"job exceeded {timeout_s} s")
        time.sleep(0.005)


def run_job(args: argparse.Namespace, variant: str, rows: int) -> JobResult:
    """One torchrun job: ``variant`` with a table of ``rows`` rows."""
    with jobs.job_dir(f"lhbench-emb-{variant}-{rows}-", args.keep_logs) as workdir:
        print(f"[{variant}, {rows:,} rows] {NPROC} workers (logs: {workdir}) ...", flush=True)
        t0 = time.monotonic()
        with jobs.torchrun(NPROC, WORKER, worker_argv(args, variant, rows, workdir), workdir) as proc:
            try:
                sampler, other_cores = serve(proc, workdir, args.sample_interval, args.timeout)
                worker = json.loads((workdir / "rank0.json").read_text())
                result = JobResult(
                    variant, rows, ok=True, worker=worker, other_cores=other_cores, **sampler.found()
                )
                print(
                    f"    PSS {result.pss / 2**30:.3f} GiB ({sampler.samples} samples), "
                    f"{result.worker['samples_per_s']:,.0f} samples/s, "
                    f"other processes {other_cores:.2f} cores, job {time.monotonic() - t0:.0f} s",
                    flush=True,
                )
                return result
            except Exception as exc:  # report and go on with the next job
                return JobResult(variant, rows, ok=False, error=f"{exc}\n{jobs.tail(workdir / 'job.log')}")


def run_job_when_idle(args: argparse.Namespace, variant: str, rows: int) -> JobResult:
    """``run_job``, after ``--wait-idle``; rerun up to ``--retry-busy`` times while others used the CPU."""
    attempt = lambda n: replace(run_job(args, variant, rows), attempts=n)
    note = "    other processes used {:.2f} cores: running it again"
    return jobs.run_until_quiet(
        attempt, args.retry_busy, args.wait_idle, note, indent="    ", fields=WITH_IRQ_AND_STEAL
    )


def memory_check(args: argparse.Namespace, variant: str) -> str | None:
    """Why the big-table job of ``variant`` would not fit in MemAvailable (or /dev/shm), or None."""
    table = args.rows * args.dim * 4
    need = NPROC * (TABLE_COPIES_PER_PROCESS[variant] * table + PROCESS_OVERHEAD_BYTES)
    info = meminfo()
    if need > 0.9 * info["MemAvailable"]:
        return (
            f"needs about {need / 2**30:.1f} GiB but MemAvailable is {info['MemAvailable'] / 2**30:.1f} GiB "
            "(reduce --rows or free memory; --skip-memory-check runs anyway)"
        )
    if variant == "hybrid":
        shm = shutil.disk_usage("/dev/shm") if Path("/dev/shm").is_dir() else None
        if shm is not None and table > 0.9 * shm.free:
            free = shm.free / 2**30
            return f"the table ({table / 2**30:.2f} GiB) does not fit in /dev/shm ({free:.2f} GiB free)"
    return None


# ---------------------------------------------------------------------- report
def gib(n: float) -> str:
    """Bytes in GiB, three decimals."""
    return f"{n / 2**30:.3f}"


def format_table(results: list[VariantResult]) -> str:
    """Memory and throughput of every variant."""
    header = (
        f"{'variant':<11} {'PSS big [GiB]':>13} {'PSS tiny [GiB]':>14} {'table mem [GiB]':>15} "
        f"{'x table':>7} {'Shmem [GiB]':>11} {'Anon [GiB]':>10} {'samples/s':>10} {'range':>15} "
        f"{'step [ms]':>9} {'steps':>8} {'other cores':>11}"
    )
    rows = []
    for r in results:
        if not r.ok:
            rows.append(f"{r.variant:<11} FAILED or skipped (see below)")
            continue
        table_bytes = r.big.worker["table_bytes"]
        spread = f"{min(r.throughputs):,.0f}-{max(r.throughputs):,.0f}"
        steps = f"{len(r.bigs)}x{r.big.worker['steps']}"
        rows.append(
            f"{r.variant:<11} {gib(r.big.pss):>13} {gib(r.tiny.pss):>14} {gib(r.table_memory):>15} "
            f"{r.table_memory / table_bytes:>7.2f} {gib(r.big.peak.get('Pss_Shmem', 0)):>11} "
            f"{gib(r.big.peak.get('Pss_Anon', 0)):>10} {r.samples_per_s:>10,.0f} {spread:>15} "
            f"{1000 * r.mean_step_s:>9.1f} {steps:>8} {r.other_cores:>11.2f}"
        )
    return report.text_table(header, rows)


def format_ratios(results: list[VariantResult]) -> str:
    """hybrid / ddp_sparse (with the targets) and hybrid / ddp_dense."""
    by_name = {r.variant: r for r in results if r.ok}
    hybrid = by_name.get("hybrid")
    lines = []
    if hybrid is None:
        return "ratios: hybrid not run or failed -> not evaluated"
    for base in ("ddp_sparse", "ddp_dense"):
        other = by_name.get(base)
        if other is None:
            lines.append(f"hybrid / {base}: {base} not run or failed -> not evaluated")
            continue
        mem = hybrid.table_memory / other.table_memory
        thr = hybrid.samples_per_s / other.samples_per_s
        if base == "ddp_sparse":
            mem_ok = "MET" if mem <= TARGET_MEMORY_RATIO else "NOT MET"
            thr_ok = "MET" if thr >= TARGET_THROUGHPUT_RATIO else "NOT MET"
            lines.append(
                f"table memory hybrid / {base}: {mem:.3f} (target <= {TARGET_MEMORY_RATIO}) -> {mem_ok}"
            )
            lines.append(
                f"throughput   hybrid / {base}: {thr:.3f} (target >= {TARGET_THROUGHPUT_RATIO}) -> {thr_ok}"
            )
        else:
            lines.append(f"table memory hybrid / {base}: {mem:.3f}")
            lines.append(f"throughput   hybrid / {base}: {thr:.3f}")
    return "\n".join(lines)


def print_report(args: argparse.Namespace, results: list[VariantResult], skipped: dict[str, str]) -> None:
    """Print the settings, the table, the ratios and what failed or was skipped; optionally write JSON."""
    table = args.rows * args.dim * 4
    print()
    print(
        f"{NPROC} processes on one node, table {args.rows:,} x {args.dim} float32 = {table / 1e9:.2f} GB "
        f"({table / 2**30:.3f} GiB), tiny table {args.tiny_rows:,} rows; batch {args.batch_size}/process, "
        f"1..{args.max_bag} ids/sample, zipf {args.zipf}\n"
        f"steps: warmup {args.warmup}, memory window {args.mem_steps}, timed {args.steps} "
        f"(ddp_dense: {args.dense_warmup}, {args.dense_mem_steps}, {args.dense_steps})"
    )
    print(
        "PSS: max over samples of the sum over the 4 workers; table mem = PSS(big) - PSS(tiny); x table = "
        "table mem / table bytes; Shmem/Anon: parts of PSS(big); samples/s: mean over the big-table jobs "
        "(range: min-max), steps: jobs x timed steps; other cores: most CPU use of processes outside the "
        f"job during a timed window (> {BUSY_HOST_CORES} skews samples/s)"
    )
    print(format_table(results))
    print()
    print(format_ratios(results))
    print()
    print(TORCHREC_NOTE)
    failed = [job for r in results for job in (*r.bigs, r.tiny) if job is not None and not job.ok]
    report.print_failures([(f"[{job.variant}, {job.rows:,} rows]", job.error) for job in failed])
    for variant, why in skipped.items():
        print(f"\n[{variant}] skipped: {why}")
    report.save_json(args.json_out, lambda: payload(args, results, skipped))


def payload(
    args: argparse.Namespace, results: list[VariantResult], skipped: dict[str, str]
) -> dict[str, Any]:
    """Everything as JSON: options, every job, what was skipped."""
    jobs_ = [
        {"variant": r.variant, "big": [asdict(b) for b in r.bigs], "tiny": asdict(r.tiny) if r.tiny else None}
        for r in results
    ]
    return {"config": report.config(args), "results": jobs_, "skipped": skipped, "torchrec": TORCHREC_NOTE}


def main(argv: list[str] | None = None) -> int:
    """Run the big-table jobs (repeats interleaved), then the tiny ones; report; return an exit code."""
    args = parse_args(argv)
    jobs.exit_on_sigterm()
    load1 = os.getloadavg()[0]
    if load1 > 1.0:
        print(f"note: load average {load1:.1f} before starting; other work skews the throughput", flush=True)
    results: list[VariantResult] = []
    skipped: dict[str, str] = {}
    try:
        for variant in args.variants:
            why = None if args.skip_memory_check else memory_check(args, variant)
            if why is not None:
                print(f"[{variant}] skipped: {why}", flush=True)
                skipped[variant] = why
            else:
                results.append(VariantResult(variant))
        for repeat in range(max(1, args.repeats)):  # interleaved, so slow drifts of the host hit all variants
            for r in results:
                if (repeat == 0 or r.variant != "ddp_dense") and all(b.ok for b in r.bigs):
                    r.bigs.append(run_job_when_idle(args, r.variant, args.rows))
        for r in results:
            if all(b.ok for b in r.bigs):
                r.tiny = run_job_when_idle(args, r.variant, args.tiny_rows)
        print_report(args, results, skipped)
    except KeyboardInterrupt:
        print("\ninterrupted; the running job was stopped", file=sys.stderr)
        return 130
    return 0 if all(r.ok for r in results) and not skipped else 1


if __name__ == "__main__":
    sys.exit(main())
