"""What a HybridEmbedding costs the processes of a node: the table (and its row optimizer's state) once,
in shared memory, and private memory that follows the rows a step touches, not the table's rows."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from helpers import init_gloo, run_spawned

from lightning_hier import HybridEmbedding, Topology

DIM, BATCH_IDS, STEPS, PROCESSES = 64, 1024, 4, 2
SMALL, LARGE = 1 << 16, 1 << 18  # rows: tables of 16 and 64 MiB (float32)
MAILBOXES = PROCESSES * (4 << 20)  # the gradient mailboxes' shared memory, at most 4 MiB per process
# a process's private growth: under 1/8 of the large table (a step's rows take 0.5 MiB), and under 1/16
# of the bytes the rows add from the small table to the large one; an export's under 1/16 of the table
PRIVATE_LIMIT = (LARGE * DIM * 4) // 8
SLOPE_LIMIT = 1 / 16
EXPORT_LIMIT = (LARGE * DIM * 4) // 16


def _rollup() -> dict[str, int]:
    """This process's ``/proc/self/smaps_rollup``, in bytes."""
    with open("/proc/self/smaps_rollup") as handle:
        fields = [line.split() for line in handle]
    return {f[0].rstrip(":"): int(f[1]) * 1024 for f in fields if len(f) == 3 and f[2] == "kB"}


def _attach(rows: int, rank: int, topology: Topology) -> HybridEmbedding:
    table = HybridEmbedding(rows, DIM, mode="sum", optimizer="adagrad", lr=0.01)
    table.attach(topology.intra_group, topology.inter_group, rank, managed=True)
    return table


def _train(table: HybridEmbedding, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, table.num_embeddings, (BATCH_IDS,), generator=generator)  # anywhere in it
        table(ids, torch.arange(0, BATCH_IDS, 8)).square().sum().backward()
        table.sync_gradients()
        table.apply_update()


def _memory_growth(rank: int, world: int, store: str, rows: int) -> dict[str, dict[str, int]]:
    """Growth of this process's private (``Anonymous``) and shared (``Pss_Shmem``) memory from before a
    table of ``rows`` rows was made to after every process attached it, and after a few steps."""
    init_gloo(rank, world, store)
    topology = Topology(world, rank, world).build_groups()  # one node of ``world`` processes
    # a small table through attach and training first: what the first use of anything allocates once
    # (gloo's buffers, autograd's engine, the allocator's arenas) is not the table's
    _train(_attach(1000, rank, topology), 2, rank)
    dist.barrier()
    before = _rollup()
    table = _attach(rows, rank, topology)
    dist.barrier()  # every process has mapped the table
    attached = _rollup()
    _train(table, STEPS, rank)
    dist.barrier()
    trained = _rollup()
    return {
        name: {key: snapshot[key] - before[key] for key in ("Anonymous", "Pss_Shmem")}
        for name, snapshot in (("attached", attached), ("trained", trained))
    }


def test_each_process_holds_private_memory_for_the_rows_a_step_touches_and_the_node_one_table(
    tmp_path: Path,
) -> None:
    # Anonymous: a process's private pages (heap, tensors); the table and the optimizer state are
    # shared memory, counted in Pss_Shmem (split between the processes that map a page)
    growth = {}
    for rows in (SMALL, LARGE):
        directory = tmp_path / str(rows)
        directory.mkdir()
        results = run_spawned(_memory_growth, PROCESSES, directory, rows)
        for result in results:
            assert result is not None and "error" not in result, result
        growth[rows] = results
        table_bytes = rows * DIM * 4
        # the node holds the table and adagrad's sum once, none of their pages twice (the sum is mapped
        # ahead only where the kernel prefaults: Linux 5.14 or later)
        shared = sum(result["attached"]["Pss_Shmem"] for result in results)
        assert table_bytes * 0.99 <= shared <= 2 * table_bytes + MAILBOXES, (rows, shared)
    for phase in ("attached", "trained"):
        for rank in range(PROCESSES):
            small, large = (growth[rows][rank][phase]["Anonymous"] for rows in (SMALL, LARGE))
            assert large < PRIVATE_LIMIT, (phase, rank, small, large)
            assert large - small < SLOPE_LIMIT * (LARGE - SMALL) * DIM * 4, (phase, rank, small, large)


def _export_growth(rank: int, world: int, store: str, directory: str) -> int:
    """Growth of this process's private memory from attaching a table to after exporting it twice."""
    table = HybridEmbedding(LARGE, DIM, optimizer="sgd")
    table.attach()
    before = _rollup()
    for name in ("first.tbl", "second.tbl"):
        table.export(Path(directory) / name)
    return _rollup()["Anonymous"] - before["Anonymous"]


def test_exporting_a_table_writes_its_rows_without_a_private_copy(tmp_path: Path) -> None:
    # checkpoints write every table and optimizer state the same way
    (growth,) = run_spawned(_export_growth, 1, tmp_path, str(tmp_path))
    assert isinstance(growth, int), growth
    assert growth < EXPORT_LIMIT, growth
