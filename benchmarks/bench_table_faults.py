"""What page faults cost a node-shared embedding table, and what prefaulting it at attach buys.

``HybridEmbedding`` keeps one copy of a table per node in ``/dev/shm``; every process of the node maps it.
A process takes a minor page fault at the first touch of each page it maps, so a process reading rows of
a large table keeps faulting for many steps. ``HybridEmbedding(prefault=True)`` (the default) maps every
page at attach instead (``map_table(populate=...)``, ``madvise(MADV_POPULATE_*)``).

``--processes`` forked processes map one ``--rows`` x ``--dim`` float32 table, created the way
``HybridEmbedding`` creates it, and each reads the rows of ``bench_hybrid_embedding.py``'s batches (its
own seed, bags of Zipf ids) with ``index_select``, ``--steps`` steps. This happens once with a plain
mapping (the reference) and once populated (the contender), interleaved over ``--rounds``. The script
prints, per mode, the time to map, the median read time per step after ``--warmup`` steps, the mean over
the first ``--warmup`` steps, the minor faults per step, and the ratio of the populated read to the
plain one::

    python benchmarks/bench_table_faults.py [--rows 2000000] [--dim 128] [--processes 4] [--rounds 2]

Linux only (``/dev/shm``, ``getrusage``); ``MADV_POPULATE_*`` needs Linux 5.14 or later (older kernels
map on first touch, so both modes read alike there).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _hybrid_embedding_worker import click_batch

from lightning_hier.sparse.shared_store import create_segment, segment_dir
from lightning_hier.sparse.table_file import map_table


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def read_rows(
    path: str, rank: int, populate: bool, args: argparse.Namespace, results: mp.SimpleQueue
) -> None:
    """One process: map the table, then read each step's distinct rows; report its timings."""
    torch.set_num_threads(1)
    config = {
        "rows": args.rows,
        "batch_size": args.batch_size,
        "max_bag": 8,
        "zipf": 1.05,
        "dense_features": 2,
    }
    batches = [click_batch(config, rank, step)[0].unique() for step in range(args.steps)]
    start = time.perf_counter()
    table = map_table(path, populate="read" if populate else None)
    mapped_s = time.perf_counter() - start
    read_s, faults = [], []
    for ids in batches:
        before, start = minor_faults(), time.perf_counter()
        table.index_select(0, ids)
        read_s.append(time.perf_counter() - start)
        faults.append(minor_faults() - before)
    results.put((mapped_s, read_s, faults))


def run_mode(path: str, populate: bool, args: argparse.Namespace) -> dict[str, float]:
    context = mp.get_context("fork")
    results = context.SimpleQueue()
    workers = [
        context.Process(target=read_rows, args=(path, rank, populate, args, results))
        for rank in range(args.processes)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    failed = [worker.exitcode for worker in workers if worker.exitcode != 0]
    if failed:
        raise RuntimeError(f"{len(failed)} reading process(es) failed (exit codes {failed}); see above")
    per_process = [results.get() for _ in workers]
    warm = args.warmup
    return {
        "map_s": max(mapped for mapped, _, _ in per_process),
        "read_ms": 1e3 * statistics.median(s for _, reads, _ in per_process for s in reads[warm:]),
        "first_ms": 1e3 * statistics.mean(s for _, reads, _ in per_process for s in reads[:warm]),
        "faults": statistics.mean(f for _, _, faults in per_process for f in faults[warm:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=2_000_000, help="table rows (float32)")
    parser.add_argument("--dim", type=int, default=128, help="table columns")
    parser.add_argument("--processes", type=int, default=4, help="processes mapping the table")
    parser.add_argument("--batch-size", type=int, default=1024, help="bags per step (1-8 ids each)")
    parser.add_argument("--steps", type=int, default=48, help="steps of reads per process")
    parser.add_argument("--warmup", type=int, default=8, help="first steps, reported apart")
    parser.add_argument("--rounds", type=int, default=2, help="plain / populated pairs, interleaved")
    args = parser.parse_args()
    if args.warmup >= args.steps:
        parser.error("--warmup must be smaller than --steps")
    directory = segment_dir()
    with tempfile.TemporaryDirectory(dir=directory, prefix="lhbench-faults-") as scratch:
        path = Path(scratch) / "table.tbl"
        create_segment(path, args.rows, args.dim, torch.float32)  # as HybridEmbedding creates it
        print(f"table {args.rows:,} x {args.dim} float32 in {directory}, {args.processes} processes, "
              f"{args.steps} steps of {args.batch_size} bags")  # fmt: skip
        print("| round | mapping | map [s] | read per step, median [ms] | first steps [ms] | faults/step |")
        print("|---|---|---|---|---|---|")
        ratios = []
        for round_index in range(args.rounds):
            measured = {}
            for populate in (False, True):
                measured[populate] = result = run_mode(str(path), populate, args)
                name = "populated" if populate else "plain"
                print(f"| {round_index + 1} | {name} | {result['map_s']:.2f} | {result['read_ms']:.3f} | "
                      f"{result['first_ms']:.3f} | {result['faults']:.0f} |")  # fmt: skip
            ratios.append(measured[True]["read_ms"] / measured[False]["read_ms"])
        print(f"read per step, populated / plain: {', '.join(f'{r:.2f}' for r in ratios)}")


if __name__ == "__main__":
    main()
