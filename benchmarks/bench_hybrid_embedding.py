"""Memory and throughput of a >= 1 GB embedding table: ``HybridEmbedding`` vs ``nn.EmbeddingBag`` + ddp and
TorchRec's ``DistributedModelParallel`` (table-wise, data-parallel and column-wise sharding).

Four processes on one host, Linux, no root; variants, measurements and options: benchmarks/README.md."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from harness import cli, jobs, report
from harness.cluster import watch
from harness.jobs import WITH_IRQ_AND_STEAL

WORKER = jobs.BENCH_DIR / "_hybrid_embedding_worker.py"
TORCHREC_WORKER = jobs.BENCH_DIR / "_torchrec_worker.py"
NPROC = 4
CONTENDER, REFERENCES = "hybrid", ("ddp_sparse", "ddp_dense")  # the targets are against the first
ANCHORS = ("torchrec_tw", "torchrec_dp", "torchrec_cw")  # TorchRec: table-wise, data-parallel, column-wise
DENSE_STEPS = ("ddp_dense", "torchrec_dp")  # all-reduce the whole table every step: the --dense-* step counts
RATIOS = (("table memory", "table mem [GiB]", "<=", 0.30), ("throughput  ", "samples/s", ">=", 1.0))
PAIRED_THROUGHPUT_TARGET = 1.2  # hybrid / ddp_sparse in every repeat (the jobs of a repeat run back to back)
TABLE_COPIES_PER_PROCESS = {  # rough peak, in tables
    "hybrid": 0.25,
    "ddp_dense": 3.2,
    "ddp_sparse": 1.2,
    "torchrec_tw": 0.5,  # the whole table on rank 0
    "torchrec_dp": 3.2,
    "torchrec_cw": 0.5,  # column slices of the table over the ranks
}
PROCESS_OVERHEAD_BYTES = 700 * 2**20
PSS_FIELDS, SAMPLE_INTERVAL_S = ("Pss", "Pss_Anon", "Pss_Shmem", "Pss_File", "Rss"), 0.2
FORMATS = {"x table": ".2f", "samples/s": ",.0f", "step [ms]": ".1f", "other cores": ".2f"}  # else GiB
RERUN_NOTE = "    other processes used {:.2f} cores: running it again"
TORCHREC_MISSING = "TorchRec is not installed (its install lines: benchmarks/README.md)"
OPTIONS = """
--rows            int    2_000_000  rows of the big table
--tiny-rows       int    1000       rows of the tiny (baseline) table
--dim             int    128        embedding dimension (float32)
--batch-size      int    1024       samples per process and step
--max-bag         int    8          ids per sample: uniform in 1..max-bag
--zipf            float  1.05       power-law exponent of the id ranks
--node-merge      str    leader     hybrid: HybridEmbedding(node_merge=...), leader or shared
--warmup          int    3          warm-up steps before the memory window
--mem-steps       int    5          steps of the memory-sampling window
--steps           int    40         timed steps (after the memory window)
--dense-warmup    int    1          warm-up steps of ddp_dense (~5 s a step)
--dense-mem-steps int    1          memory-window steps of ddp_dense
--dense-steps     int    4          timed steps of ddp_dense
--repeats int 2 big-table jobs per variant (interleaved; throughput = their median); ddp_dense runs once
--variants str hybrid,ddp_dense,ddp_sparse,torchrec_tw,torchrec_dp,torchrec_cw comma-separated (torchrec_*)
--skip-memory-check flag -          run even if MemAvailable looks short
"""


@dataclass
class JobResult:
    """One torchrun job: a variant with one table size; memory in bytes, at the sample with the most Pss."""

    variant: str
    rows: int
    ok: bool = True
    error: str = ""
    worker: dict[str, Any] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)  # the PSS_FIELDS summed over the workers
    per_process_pss: list[int] = field(default_factory=list)
    samples: int = 0
    other_cores: float = 0.0  # mean CPU use of processes outside this job during the timed window
    attempts: int = 1


@dataclass
class Variant:
    """A variant's big-table jobs (``--repeats``, interleaved with the other variants') and its tiny job."""

    variant: str
    big: list[JobResult] = field(default_factory=list)
    tiny: JobResult | None = None


def read_kib(path: str) -> dict[str, int]:
    """The ``key: N kB`` lines of a ``/proc`` file, in bytes."""
    with open(path) as handle:
        lines = [line.split() for line in handle]
    return {key.rstrip(":"): int(value) * 1024 for key, value, *unit in lines if unit == ["kB"]}


def run_once(args: argparse.Namespace, variant: str, rows: int, attempt: int) -> JobResult:
    """One torchrun job; at each window edge sample memory and CPU, then acknowledge; sample memory every
    ``SAMPLE_INTERVAL_S`` from "mem_start" to "start", never in the timed window ("start" to "end")."""
    prefix = "dense_" if variant in DENSE_STEPS else ""
    config = {k: getattr(args, prefix + k) for k in ("warmup", "mem_steps", "steps")}
    shape = jobs.pick(args, "dim", "batch_size", "max_bag", "zipf", "node_merge")
    config.update(variant=variant, rows=rows, **shape)
    result = JobResult(variant, rows, attempts=attempt)
    pids: list[int] = []
    cpu: dict[str, jobs.Snapshot] = {}
    next_sample = 0.0

    def sample() -> None:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a worker is exiting
            rollups = [read_kib(f"/proc/{pid}/smaps_rollup") for pid in pids]
            total = {k: sum(r.get(k, 0) for r in rollups) for k in PSS_FIELDS}
            result.samples += 1
            if total["Pss"] > result.peak.get("Pss", -1):
                result.peak, result.per_process_pss = total, [r["Pss"] for r in rollups]

    def at_edge(phase: str) -> None:  # at_edge and tick run inside watch: workdir, proc, markers are set
        pids[:] = pids or jobs.live_workers(workdir, NPROC)  # all wrote their pid before the first step
        sample()
        cpu[phase] = jobs.cpu_snapshot([proc.pid, *pids], WITH_IRQ_AND_STEAL)

    def tick() -> None:
        nonlocal next_sample
        markers.answer(at_edge)
        if pids and "start" not in markers.acked and time.monotonic() >= next_sample:
            sample()
            next_sample = time.monotonic() + SAMPLE_INTERVAL_S

    with jobs.job_dir(f"lhbench-emb-{variant}-{rows}-", args.keep_logs) as workdir:
        print(f"[{variant}, {rows:,} rows] {NPROC} workers (logs: {workdir}) ...", flush=True)
        markers = jobs.Markers(workdir, ("mem_start", "start", "end"))
        worker = TORCHREC_WORKER if variant in ANCHORS else WORKER
        with jobs.torchrun(NPROC, worker, [json.dumps({**config, "job_dir": str(workdir)})], workdir) as proc:
            try:
                watch([proc], args.timeout, 0.005, tick)
                result.worker = json.loads((workdir / "rank0.json").read_text())
                result.other_cores = jobs.other_cores(cpu["start"], cpu["end"])
            except Exception as exc:  # report it and go on with the next job
                error = f"{exc}\n{jobs.tail(workdir / 'job.log')}"
                return JobResult(variant, rows, ok=False, error=error, attempts=attempt)
    return result


def run_job(args: argparse.Namespace, variant: str, rows: int) -> JobResult:
    """``run_once`` after ``--wait-idle``; again, up to ``--retry-busy`` times, while others used the CPU."""
    job = lambda attempt: run_once(args, variant, rows, attempt)
    return jobs.run_until_quiet(job, args.retry_busy, args.wait_idle, RERUN_NOTE, fields=WITH_IRQ_AND_STEAL)


def memory_check(args: argparse.Namespace, variant: str) -> str | None:
    """Why the big-table job of ``variant`` would not fit in MemAvailable (or /dev/shm), or None."""
    table = args.rows * args.dim * 4
    need = NPROC * (TABLE_COPIES_PER_PROCESS[variant] * table + PROCESS_OVERHEAD_BYTES)
    available = read_kib("/proc/meminfo")["MemAvailable"]
    if need > 0.9 * available:
        return f"needs ~{need / 2**30:.1f} GiB, MemAvailable is {available / 2**30:.1f} GiB (reduce --rows)"
    if variant == "hybrid" and table > 0.9 * (shm_free := shutil.disk_usage("/dev/shm").free):
        return f"the table ({table / 2**30:.2f} GiB) does not fit in /dev/shm ({shm_free / 2**30:.2f} free)"
    return None


def summary(bigs: list[JobResult], tiny: JobResult) -> dict[str, Any]:
    """A variant's row of the table, by column; memory is the max over all samples of all repeats,
    throughput the median of the repeats with their spread."""
    big = max(bigs, key=lambda b: b.peak["Pss"])
    table = big.peak["Pss"] - tiny.peak["Pss"]
    rates = [float(b.worker["samples_per_s"]) for b in bigs]
    return {
        "PSS big [GiB]": big.peak["Pss"] / 2**30,
        "PSS tiny [GiB]": tiny.peak["Pss"] / 2**30,
        "table mem [GiB]": table / 2**30,
        "x table": table / big.worker["table_bytes"],
        "Shmem [GiB]": big.peak.get("Pss_Shmem", 0) / 2**30,
        "Anon [GiB]": big.peak.get("Pss_Anon", 0) / 2**30,
        "samples/s": statistics.median(rates),
        "samples/s range": f"{min(rates):,.0f}-{max(rates):,.0f}",
        "step [ms]": 1000 * statistics.median(float(b.worker["median_step_s"]) for b in bigs),
        "jobs x steps": f"{len(bigs)}x{big.worker['steps']}",
        "other cores": max(b.other_cores for b in bigs),
    }


def paired_throughput(bigs: dict[str, list[JobResult]], base: str = REFERENCES[0]) -> list[float]:
    """hybrid / ``base`` throughput per repeat: the jobs of one repeat ran back to back, so each
    ratio sees one state of the host."""
    pairs = zip(bigs.get(CONTENDER, []), bigs.get(base, []))
    return [
        float(a.worker["samples_per_s"]) / float(b.worker["samples_per_s"]) for a, b in pairs if a.ok and b.ok
    ]


def print_paired_throughput(bigs: dict[str, list[JobResult]]) -> None:
    ratios = paired_throughput(bigs)
    if not ratios:
        return
    listed = ", ".join(f"{r:.3f}" for r in ratios)
    met = min(ratios) >= PAIRED_THROUGHPUT_TARGET
    median = statistics.median(ratios)
    print(
        f"throughput   {CONTENDER} / {REFERENCES[0]} per repeat: {listed} (median {median:.3f}, "
        f"spread {min(ratios):.3f}-{max(ratios):.3f}; target >= {PAIRED_THROUGHPUT_TARGET} in every repeat) "
        f"-> {'MET' if met else 'NOT MET'}"
    )


def anchor_verdict(done: dict[str, dict[str, Any]], bigs: dict[str, list[JobResult]], anchor: str) -> str:
    """The goal against a TorchRec anchor: more samples/s (median of the repeats) at no more memory per
    node (the job's peak PSS: its 4 processes, a shared page such as the /dev/shm table counted once)."""
    if not {CONTENDER, anchor} <= done.keys():
        return f"goal {CONTENDER} / {anchor}: not evaluated ({CONTENDER} or {anchor} failed or not run)"
    throughput = done[CONTENDER]["samples/s"] / done[anchor]["samples/s"]
    memory = done[CONTENDER]["PSS big [GiB]"] / done[anchor]["PSS big [GiB]"]
    per_repeat = ", ".join(f"{r:.3f}" for r in paired_throughput(bigs, anchor))
    met = throughput > 1.0 and memory <= 1.0
    return (
        f"goal {CONTENDER} / {anchor}: throughput {throughput:.3f} (per repeat {per_repeat}), "
        f"memory per node {memory:.3f} (target: throughput > 1, memory <= 1) -> {'MET' if met else 'NOT MET'}"
    )


def print_report(
    args: argparse.Namespace, variants: list[Variant], skipped: dict[str, str], notes: list[str]
) -> None:
    """The settings, the table, the ratios (with the targets), the TorchRec goal, the failures; the JSON."""
    gb = args.rows * args.dim * 4 / 1e9
    print(f"\ntable {args.rows:,} x {args.dim} float32 ({gb:.2f} GB), tiny table {args.tiny_rows:,} rows")
    done = {v.variant: summary(v.big, v.tiny) for v in variants if v.tiny and v.tiny.ok}
    cell = lambda k, x: (x if isinstance(x, str) else format(x, FORMATS.get(k, ".3f"))).rjust(len(k))
    cells = {name: [cell(k, x) for k, x in row.items()] for name, row in done.items()}
    rows = [" ".join([f"{v.variant:<11}", *cells.get(v.variant, ["FAILED (see below)"])]) for v in variants]
    print(report.text_table(" ".join([f"{'variant':<11}", *next(iter(done.values()), {})]), rows) + "\n")
    bigs = {v.variant: v.big for v in variants}
    for base in REFERENCES:
        if base not in args.variants:
            continue
        if not {CONTENDER, base} <= done.keys():
            print(f"{CONTENDER} / {base}: not evaluated ({CONTENDER} or {base} failed or not run)")
            continue
        for label, column, sign, target in RATIOS:
            ratio = done[CONTENDER][column] / done[base][column]
            met = ratio <= target if sign == "<=" else ratio >= target
            verdict = f" (target {sign} {target}) -> {'MET' if met else 'NOT MET'}"
            print(f"{label} {CONTENDER} / {base}: {ratio:.3f}{verdict if base == REFERENCES[0] else ''}")
    print_paired_throughput(bigs)
    verdicts = [anchor_verdict(done, bigs, anchor) for anchor in ANCHORS if anchor in args.variants]
    print("\n".join(["", *verdicts, *notes]))
    failed = [job for v in variants for job in (*v.big, v.tiny) if job and not job.ok]
    report.print_failures([(f"[{job.variant}, {job.rows:,} rows]", job.error) for job in failed])
    payload = {"config": report.config(args), "results": [asdict(v) for v in variants], "skipped": skipped}
    report.save_json(args.json_out, lambda: {**payload, "torchrec": [*verdicts, *notes]})


def torchrec_missing() -> str | None:
    """Why TorchRec cannot run here (not installed, or its fbgemm library does not load), or None."""
    try:
        import torchrec  # noqa: F401
    except Exception as exc:  # ImportError, or an OSError from a CUDA fbgemm-gpu on a CPU-only torch
        return f"{TORCHREC_MISSING}: {type(exc).__name__}: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the big-table jobs (repeats interleaved), then the tiny ones; report; return an exit code."""
    run_options = cli.RUN_OPTIONS.format(timeout=600, per="job", logs="the per-job temp dirs")
    p = cli.parser(__doc__, OPTIONS, run_options, cli.IDLE_OPTIONS.format(job="job"))
    args = p.parse_args(argv)
    jobs.exit_on_sigterm()
    args.variants = cli.comma_list(args.variants)
    if not set(args.variants) <= set(TABLE_COPIES_PER_PROCESS):
        p.error(f"--variants: choose from {', '.join(TABLE_COPIES_PER_PROCESS)}")
    notes = []
    if set(ANCHORS) & set(args.variants) and (why := torchrec_missing()):
        notes.append(f"TorchRec not run: {why}")
        args.variants = [n for n in args.variants if n not in ANCHORS]
        print(notes[-1], flush=True)
    skipped = {n: why for n in args.variants if not args.skip_memory_check and (why := memory_check(args, n))}
    for name, why in skipped.items():
        print(f"[{name}] skipped: {why} (--skip-memory-check runs it anyway)", flush=True)
    variants = [Variant(name) for name in args.variants if name not in skipped]
    for repeat in range(max(1, args.repeats)):  # interleaved, so slow drifts of the host hit all variants
        for v in variants:
            if (repeat == 0 or v.variant != "ddp_dense") and all(b.ok for b in v.big):
                v.big.append(run_job(args, v.variant, args.rows))
    for v in variants:
        if all(b.ok for b in v.big):
            v.tiny = run_job(args, v.variant, args.tiny_rows)
    print_report(args, variants, skipped, notes)
    return 0 if all(v.tiny and v.tiny.ok for v in variants) and not skipped else 1


if __name__ == "__main__":
    sys.exit(main())
