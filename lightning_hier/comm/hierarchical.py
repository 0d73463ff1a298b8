"""Sliced reduce-scatter inside a node -> all-reduce across nodes -> all-gather inside a node.

The collectives here are plain ``torch.distributed`` calls on the two groups of a
:class:`~lightning_hier.topology.Topology`. Uneven slices (weighted plans) use the list forms;
gloo has no uneven all-gather, so that one becomes one broadcast per slice.

:class:`HierarchicalReducer` pipelines buckets. A bucket's inter-node all-reduce may only start
once its intra-node reduce-scatter has finished. On NCCL that ordering could ride on streams, but
on gloo ``wait()`` blocks the caller, so a dedicated communication thread runs the chain bucket
by bucket: while it waits for bucket ``i+1``'s reduce-scatter, bucket ``i``'s all-reduce is
already in flight on the inter group, and the training thread keeps running backward. Buckets
larger than ``chunk_bytes`` are pipelined the same way chunk by chunk, so the slow link starts
after one chunk's reduce-scatter rather than a whole bucket's. Buckets
are issued strictly in plan order on every rank, so all ranks issue the same collectives in the
same order on each group.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

Bounds = Sequence[tuple[int, int]]


def _is_equal(bounds: Bounds) -> bool:
    sizes = {end - start for start, end in bounds}
    return len(sizes) == 1 and bounds[0][0] == 0


def reduce_scatter_into(
    out: torch.Tensor, flat: torch.Tensor, bounds: Bounds, group: dist.ProcessGroup
) -> None:
    """Sum ``flat`` over ``group`` and leave slice ``group_rank`` of the sum in ``out``."""
    if dist.get_world_size(group) == 1:
        out.copy_(flat[bounds[0][0] : bounds[0][1]])
        return
    if _is_equal(bounds) and flat.numel() == bounds[-1][1]:
        dist.reduce_scatter_single(out, flat, group=group)
    else:
        dist.reduce_scatter(out, [flat[start:end] for start, end in bounds], group=group)


def all_gather_slices(flat: torch.Tensor, bounds: Bounds, group: dist.ProcessGroup) -> list[dist.Work]:
    """Fill every slice of ``flat`` from its owner in ``group`` (in place); returns works to wait on."""
    if dist.get_world_size(group) == 1:
        return []
    if _is_equal(bounds) and flat.numel() == bounds[-1][1]:
        mine = bounds[dist.get_rank(group)]
        return [dist.all_gather_single(flat, flat[mine[0] : mine[1]], group=group, async_op=True)]
    works = []
    for owner, (start, end) in enumerate(bounds):
        if end > start:
            works.append(dist.broadcast(flat[start:end], group=group, group_src=owner, async_op=True))
    return works


@dataclass
class ReduceJob:
    """One bucket's trip through the hierarchy; ``out`` ends up holding the global sum of its slice."""

    flat: torch.Tensor
    bounds: Bounds
    out: torch.Tensor
    scatter_done: threading.Event = field(default_factory=threading.Event)
    inter_works: list[dist.Work] = field(default_factory=list)
    error: BaseException | None = None
    submitted_at: float = 0.0  # time.perf_counter() clock
    scatter_done_at: float = 0.0
    done_at: float = 0.0

    def mark_done(self) -> None:
        self.done_at = time.perf_counter()


class HierarchicalReducer:
    """Runs :class:`ReduceJob` s in submission order on a background communication thread."""

    def __init__(
        self, intra_group: dist.ProcessGroup, inter_group: dist.ProcessGroup, chunk_bytes: int = 4 << 20
    ) -> None:
        self.intra_group = intra_group
        self.inter_group = inter_group
        self.chunk_bytes = chunk_bytes
        self._intra_size = dist.get_world_size(intra_group)
        self._intra_rank = dist.get_rank(intra_group)
        self._inter_size = dist.get_world_size(inter_group)
        self._jobs: queue.Queue[ReduceJob | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def submit(self, job: ReduceJob) -> ReduceJob:
        job.submitted_at = time.perf_counter()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lightning_hier-comm", daemon=True)
            self._thread.start()
        self._jobs.put(job)
        return job

    def wait(self, job: ReduceJob) -> torch.Tensor:
        """Block until ``job`` is fully reduced; re-raises a communication error from the thread."""
        job.scatter_done.wait()
        if job.error is not None:
            raise job.error
        for work in job.inter_works:
            work.wait()
        job.inter_works = []
        job.done_at = max(job.done_at, job.scatter_done_at)
        return job.out

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=5)
            self._thread = None

    def _pieces(self, job: ReduceJob) -> list[tuple[list[tuple[int, int]] | None, tuple[int, int]]]:
        """Cut a large bucket into chunks, each a piece of every slice, so chunk ``c``'s inter-node
        all-reduce overlaps chunk ``c+1``'s reduce-scatter inside one bucket too.

        Returns ``(input ranges per slice or None for the whole bucket, output range)`` pairs.
        """
        sizes = [end - start for start, end in job.bounds]
        chunk = max(1, self.chunk_bytes // job.flat.element_size())
        count = -(-max(sizes) // chunk) if max(sizes) > 0 else 1
        if count <= 1 or self._intra_size == 1:
            return [(None, (0, job.out.numel()))]
        pieces = []
        for c in range(count):
            ranges = [
                (start + c * size // count, start + (c + 1) * size // count)
                for (start, _), size in zip(job.bounds, sizes)
            ]
            mine = sizes[self._intra_rank]
            pieces.append((ranges, (c * mine // count, (c + 1) * mine // count)))
        return pieces

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                for piece_bounds, (lo, hi) in self._pieces(job):
                    out = job.out[lo:hi]
                    if piece_bounds is None:
                        reduce_scatter_into(out, job.flat, job.bounds, self.intra_group)
                    else:
                        inputs = [job.flat[start:end] for start, end in piece_bounds]
                        dist.reduce_scatter(out, inputs, group=self.intra_group)
                    job.scatter_done_at = job.done_at = time.perf_counter()
                    if self._inter_size > 1:
                        work = dist.all_reduce(out, group=self.inter_group, async_op=True)
                        work.get_future().add_done_callback(lambda _, job=job: job.mark_done())
                        job.inter_works.append(work)
            except BaseException as err:  # handed to the training thread in wait()
                job.error = err
            finally:
                job.scatter_done.set()
