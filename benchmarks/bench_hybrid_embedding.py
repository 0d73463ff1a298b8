"""Memory and throughput of a >= 1 GB embedding table: ``HybridEmbedding`` vs ``nn.EmbeddingBag`` + ddp.

Four trainer processes on one host (one node) train a click-through-style model: one embedding
table of ``--rows`` x ``--dim`` float32 (default 2,000,000 x 128 = 1.02 GB) looked up as bags of
1..8 Zipf-distributed ids per sample, pooled by sum, with a small MLP on top.  Variants:

* ``hybrid``:     ``HybridEmbedding(mode="sum", optimizer="sgd")`` with
  ``HierSlicedStrategy(devices_per_node=4)``: one copy of the table per node in ``/dev/shm``;
* ``ddp_dense``:  ``nn.EmbeddingBag(mode="sum")`` with Lightning's ``ddp``;
* ``ddp_sparse``: ``nn.EmbeddingBag(mode="sum", sparse=True)`` with Lightning's ``ddp``;
* TorchRec's ``EmbeddingBagCollection`` is not run (see ``TORCHREC_NOTE``).

Every variant is launched with ``python -m torch.distributed.run --standalone --nproc_per_node 4``
twice: with the big table and with a tiny one (``--tiny-rows``).  While the ranks train through
a memory window of ``--mem-steps`` steps after the warm-up (see ``_hybrid_embedding_worker.py``)
this driver samples the PSS of the four worker processes from ``/proc/<pid>/smaps_rollup``
every ``--sample-interval`` seconds (and once at each window edge) and sums them; the job's
memory is the largest sum.  Then ``--steps`` steps are timed without sampling (a sample of four
processes mapping gigabytes costs ~0.1 CPU-second, which would slow a 2-core host).  PSS divides
a shared page among the processes that map it, so the ``/dev/shm`` table of ``hybrid`` counts
once per node, not once per process.
``table memory`` = PSS(job, big table) - PSS(same job, tiny table), so the processes' own
overhead (interpreter, torch, gloo, Lightning) does not hide the effect.

Reported: memory, throughput (samples/s over the timed steps, all ranks), and the ratios
``hybrid / ddp_sparse`` (table memory, target <= 0.30; throughput, target >= 1.0) and
``hybrid / ddp_dense``.  Needs no root; Linux only (``/proc``)::

    python benchmarks/bench_hybrid_embedding.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
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
WORKER = HERE / "_hybrid_embedding_worker.py"
NPROC = 4
VARIANTS = ("hybrid", "ddp_dense", "ddp_sparse")
TARGET_MEMORY_RATIO = 0.30
TARGET_THROUGHPUT_RATIO = 1.0
PSS_FIELDS = ("Pss", "Pss_Anon", "Pss_Shmem", "Pss_File", "Rss")
PHASES = ("mem_start", "start", "end")
BUSY_HOST_CORES = 0.2  # CPU use of other processes (cores) above which a host counts as busy
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
TORCHREC_NOTE = (
    "TorchRec: not available for torch 2.13 CPU (`pip install torchrec` resolves torchrec 1.9.2 with "
    "fbgemm-gpu 1.9.0, a CUDA build for torch 2.14 that needs libtorch_cuda.so, and downgrades torchmetrics "
    "to 1.0.3; the CPU pair for torch 2.13, torchrec 1.8.0 + fbgemm-gpu-cpu 1.8.0, installs only by hand "
    "with --no-deps, and TorchRec's sharded training (DistributedModelParallel) has no Lightning strategy)"
)
# rough peak bytes per process for the big table, as multiples of the table size (for the memory check)
TABLE_COPIES_PER_PROCESS = {"hybrid": 0.25, "ddp_dense": 3.2, "ddp_sparse": 1.2}
PROCESS_OVERHEAD_BYTES = 700 * 2**20


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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2_000_000, help="rows of the big table")
    p.add_argument("--tiny-rows", type=int, default=1000, help="rows of the tiny (baseline) table")
    p.add_argument("--dim", type=int, default=128, help="embedding dimension (float32)")
    p.add_argument("--batch-size", type=int, default=1024, help="samples per process and step")
    p.add_argument("--max-bag", type=int, default=8, help="ids per sample: uniform in 1..max-bag")
    p.add_argument("--zipf", type=float, default=1.05, help="power-law exponent of the id ranks")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps before the memory window")
    p.add_argument("--mem-steps", type=int, default=5, help="steps of the memory-sampling window")
    p.add_argument("--steps", type=int, default=40, help="timed steps (after the memory window)")
    p.add_argument("--dense-warmup", type=int, default=1, help="warm-up steps of ddp_dense (~5 s a step)")
    p.add_argument("--dense-mem-steps", type=int, default=1, help="memory-window steps of ddp_dense")
    p.add_argument("--dense-steps", type=int, default=4, help="timed steps of ddp_dense")
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="big-table jobs per variant (interleaved; throughput = their mean); ddp_dense runs once",
    )
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: " + ", ".join(VARIANTS))
    p.add_argument("--sample-interval", type=float, default=0.2, help="seconds between PSS samples")
    p.add_argument("--json-out", type=Path, default=None, help="write all results as JSON here")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per job")
    p.add_argument("--keep-logs", action="store_true", help="keep the per-job temp dirs with worker logs")
    p.add_argument(
        "--wait-idle",
        type=float,
        default=0,
        help="before each job, wait up to this many seconds for other processes to leave the CPU",
    )
    p.add_argument(
        "--retry-busy",
        type=int,
        default=0,
        help="rerun a job (after --wait-idle) up to this many times when other processes used the CPU",
    )
    p.add_argument("--skip-memory-check", action="store_true", help="run even if MemAvailable looks short")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
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


def cpu_snapshot(pids: list[int]) -> tuple[float, float, float]:
    """``(time, busy CPU seconds of the host, CPU seconds of pids and of this driver)``."""
    with open("/proc/stat") as handle:
        fields = [int(x) for x in handle.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal (guest time is already in user)
    busy = sum(fields[:3]) + sum(fields[5:8])
    own = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                rest = handle.read().rpartition(")")[2].split()
            own += int(rest[11]) + int(rest[12])  # utime, stime (all threads)
        except (FileNotFoundError, ProcessLookupError):
            pass
    driver = os.times()
    return time.monotonic(), busy / CLOCK_TICKS, own / CLOCK_TICKS + driver.user + driver.system


def other_cpu_cores(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """Mean CPU use (cores) between two snapshots of processes other than the snapshots' pids."""
    elapsed = after[0] - before[0]
    if elapsed <= 0:
        return 0.0
    return max(0.0, ((after[1] - before[1]) - (after[2] - before[2])) / elapsed)


def wait_idle(timeout_s: float, sample_s: float = 2.0) -> float:
    """Wait (up to ``timeout_s``) until other processes use less than ``BUSY_HOST_CORES``; returns
    the last sampled use in cores."""
    deadline = time.monotonic() + timeout_s
    while True:
        before = cpu_snapshot([])
        time.sleep(sample_s)
        other = other_cpu_cores(before, cpu_snapshot([]))
        if other <= BUSY_HOST_CORES or time.monotonic() >= deadline:
            return other
        print(f"    host busy ({other:.2f} cores used by other processes), waiting ...", flush=True)


class PssSampler:
    """Sums the worker processes' smaps_rollup fields; keeps the sample with the largest total Pss."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
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


# ---------------------------------------------------------------------- jobs
def worker_argv(args: argparse.Namespace, variant: str, rows: int, workdir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(NPROC),
        str(WORKER),
        "--variant",
        variant,
        "--rows",
        str(rows),
        "--dim",
        str(args.dim),
        "--batch-size",
        str(args.batch_size),
        "--max-bag",
        str(args.max_bag),
        "--zipf",
        str(args.zipf),
        "--warmup",
        str(args.dense_warmup if variant == "ddp_dense" else args.warmup),
        "--mem-steps",
        str(args.dense_mem_steps if variant == "ddp_dense" else args.mem_steps),
        "--steps",
        str(args.dense_steps if variant == "ddp_dense" else args.steps),
        "--signal-dir",
        str(workdir),
        "--out",
        str(workdir / "rank0.json"),
    ]


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


def worker_pids(workdir: Path) -> list[int]:
    files = [workdir / f"pid.{rank}" for rank in range(NPROC)]
    if not all(f.exists() for f in files):
        raise RuntimeError("the window started before every worker wrote its pid")
    return [int(f.read_text()) for f in files]


def live_workers(workdir: Path) -> list[int]:
    """Pids of this job's workers that still run (checked by command line: pids can be reused)."""
    pids = []
    for rank in range(NPROC):
        with contextlib.suppress(OSError, ValueError):
            pid = int((workdir / f"pid.{rank}").read_text())
            if str(workdir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
    return pids


def stop_job(proc: subprocess.Popen[bytes], workdir: Path, grace_s: float = 5.0) -> None:
    """Stop what this job started, by id: the launcher's process group and the workers (which
    ``torch.distributed.run`` starts in sessions of their own). SIGTERM first, SIGKILL after ``grace_s``."""

    def signal_workers(sig: int) -> None:
        for pid in live_workers(workdir):
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


def serve(
    proc: subprocess.Popen[bytes], workdir: Path, interval: float, timeout_s: float
) -> tuple[PssSampler, float]:
    """Until the job exits: ack the windows' edges (a memory sample at each), sample memory
    between "mem_start" and "start", and leave the timed window ("start" to "end") alone.

    Returns the sampler and the mean CPU use (cores) of other processes during the timed window.
    """
    sampler: PssSampler | None = None
    cpu: dict[str, tuple[float, float, float]] = {}
    acked: set[str] = set()
    deadline = time.monotonic() + timeout_s
    next_sample = 0.0
    while True:
        for phase in PHASES:
            if phase not in acked and (workdir / f"{phase}.ready").exists():
                if sampler is None:
                    sampler = PssSampler(worker_pids(workdir))
                sampler.sample()
                cpu[phase] = cpu_snapshot([proc.pid, *sampler.pids])
                (workdir / f"{phase}.ack").touch()
                acked.add(phase)
        now = time.monotonic()
        if sampler is not None and "start" not in acked and now >= next_sample:
            sampler.sample()
            next_sample = now + interval
        code = proc.poll()
        if code is not None:
            if code != 0:
                raise RuntimeError(f"torch.distributed.run exited with code {code}")
            if sampler is None or acked != set(PHASES):
                raise RuntimeError(f"the job finished without signalling {sorted(set(PHASES) - acked)}")
            return sampler, other_cpu_cores(cpu["start"], cpu["end"])
        if now > deadline:
            raise TimeoutError(f"job exceeded {timeout_s} s")
        time.sleep(0.005)


def log_tail(workdir: Path, lines: int = 30) -> str:
    log = workdir / "job.log"
    if not log.exists():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def run_job(args: argparse.Namespace, variant: str, rows: int) -> JobResult:
    workdir = Path(tempfile.mkdtemp(prefix=f"lhbench-emb-{variant}-{rows}-"))
    print(f"[{variant}, {rows:,} rows] {NPROC} workers (logs: {workdir}) ...", flush=True)
    t0 = time.monotonic()
    with open(workdir / "job.log", "wb") as log:
        proc = subprocess.Popen(
            worker_argv(args, variant, rows, workdir),
            env=worker_env(),
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        sampler, other_cores = serve(proc, workdir, args.sample_interval, args.timeout)
        worker = json.loads((workdir / "rank0.json").read_text())
        result = JobResult(
            variant,
            rows,
            ok=True,
            worker=worker,
            peak=sampler.peak,
            per_process_pss=sampler.per_process,
            samples=sampler.samples,
            other_cores=other_cores,
        )
        print(
            f"    PSS {result.pss / 2**30:.3f} GiB ({sampler.samples} samples), "
            f"{result.worker['samples_per_s']:,.0f} samples/s, other processes {other_cores:.2f} cores, "
            f"job {time.monotonic() - t0:.0f} s",
            flush=True,
        )
        return result
    except Exception as exc:  # report and go on with the next job
        return JobResult(variant, rows, ok=False, error=f"{exc}\n{log_tail(workdir)}")
    finally:
        stop_job(proc, workdir)
        if not args.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)


def run_job_when_idle(args: argparse.Namespace, variant: str, rows: int) -> JobResult:
    """``run_job``, after ``--wait-idle``; rerun up to ``--retry-busy`` times while others used the CPU."""
    best: JobResult | None = None
    for attempt in range(1, args.retry_busy + 2):
        if args.wait_idle > 0:
            wait_idle(args.wait_idle)
        result = run_job(args, variant, rows)
        result.attempts = attempt
        if not result.ok:
            return result
        if best is None or result.other_cores < best.other_cores:
            best = result
        if result.other_cores <= BUSY_HOST_CORES:
            break
        if attempt <= args.retry_busy:
            print(f"    other processes used {result.other_cores:.2f} cores: running it again", flush=True)
    assert best is not None
    return best


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
    return f"{n / 2**30:.3f}"


def format_table(results: list[VariantResult]) -> str:
    header = (
        f"{'variant':<11} {'PSS big [GiB]':>13} {'PSS tiny [GiB]':>14} {'table mem [GiB]':>15} "
        f"{'x table':>7} {'Shmem [GiB]':>11} {'Anon [GiB]':>10} {'samples/s':>10} {'range':>15} "
        f"{'step [ms]':>9} {'steps':>8} {'other cores':>11}"
    )
    rows = [header, "-" * len(header)]
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
    return "\n".join(rows)


def format_ratios(results: list[VariantResult]) -> str:
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


def report(args: argparse.Namespace, results: list[VariantResult], skipped: dict[str, str]) -> None:
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
    for r in results:
        for job in (*r.bigs, r.tiny):
            if job is not None and not job.ok:
                print(f"\n[{job.variant}, {job.rows:,} rows] FAILED:\n{job.error}")
    for variant, why in skipped.items():
        print(f"\n[{variant}] skipped: {why}")
    if args.json_out:
        payload = {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "results": [
                {
                    "variant": r.variant,
                    "big": [asdict(b) for b in r.bigs],
                    "tiny": asdict(r.tiny) if r.tiny else None,
                }
                for r in results
            ],
            "skipped": skipped,
            "torchrec": TORCHREC_NOTE,
        }
        args.json_out.write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {args.json_out}")


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
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
        report(args, results, skipped)
    except KeyboardInterrupt:
        print("\ninterrupted; the running job was stopped", file=sys.stderr)
        return 130
    return 0 if all(r.ok for r in results) and not skipped else 1


if __name__ == "__main__":
    sys.exit(main())
