"""Sliced reduce-scatter inside a node -> all-reduce across nodes -> all-gather inside a node.

The collectives here are plain ``torch.distributed`` calls on the two groups of a
:class:`~lightning_hier.topology.Topology`. Uneven slices (weighted plans) use the list forms;
gloo has no uneven all-gather, so that one becomes one broadcast per slice.

:class:`HierarchicalReducer` pipelines buckets. A bucket's inter-node all-reduce may only start
once its intra-node reduce-scatter has finished. Two implementations keep that order, one per
backend, behind the same ``submit`` / ``wait`` / ``close`` interface (:func:`make_reducer`):

- :class:`InlineReducer` (CUDA, and CPU runs that emulate it): issues the chain from the thread
  that submits (the backward hooks, as DDP's reducer does) with asynchronous work handles, on a
  side stream of its own (:mod:`lightning_hier.sliced.comm_stream`): ``work.wait()`` on an NCCL
  handle makes the *current* stream wait, so with the side stream current the all-reduce is queued
  behind the reduce-scatter there while the compute stream goes on with backward, and the compute
  stream waits once, in :meth:`~HierarchicalReducer.wait_all`, before the optimizer reads the
  slices. Every rank issues the same collectives in the same order from one thread, which NCCL
  needs: kernels of different communicators enqueued in different orders on different ranks can
  deadlock.
- :class:`ThreadedReducer` (gloo): ``wait()`` blocks the caller there, so a communication thread
  runs the chain bucket by bucket; while it waits for bucket ``i+1``'s reduce-scatter, bucket
  ``i``'s all-reduce is already in flight on the inter group. Gloo has no stream ordering to
  break, and this overlaps more on CPU than blocking the backward pass would. On CUDA
  (``reducer="thread"``) the thread issues on the same side stream, after the event the submitting
  hook recorded on the gradients' stream.

A group of one rank skips its collectives unless ``LIGHTNING_HIER_FORCE_COLLECTIVES=1``
(:mod:`lightning_hier.single_rank`), which a one-GPU check sets to run the whole chain on NCCL.

Buckets larger than ``chunk_bytes`` are pipelined chunk by chunk, so the slow link starts after
one chunk's reduce-scatter rather than a whole bucket's. Buckets are issued strictly in plan
order on every rank.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist

from lightning_hier.single_rank import alone, alone_in
from lightning_hier.sliced.comm_stream import HostStream, comm_stream_for
from lightning_hier.sliced.compressed_hop import compresses, start_compressed_all_reduce
from lightning_hier.topology import runs_as_cuda

log = logging.getLogger(__name__)

Bounds = Sequence[tuple[int, int]]


def _is_equal(bounds: Bounds) -> bool:
    sizes = {end - start for start, end in bounds}
    return len(sizes) == 1 and bounds[0][0] == 0


def _flat_collective(name: str, older_name: str):  # noqa: ANN202
    """``torch.distributed``'s collective ``name`` (torch 2.13), or ``older_name`` on releases before the
    rename; looked up at each call, so that the wrappers of CommProfiler and the audit see the call."""
    return getattr(dist, name, None) or getattr(dist, older_name)


def reduce_scatter_into(
    out: torch.Tensor, flat: torch.Tensor, bounds: Bounds, group: dist.ProcessGroup, async_op: bool = False
) -> dist.Work | None:
    """Sum ``flat`` over ``group`` and leave slice ``group_rank`` of the sum in ``out``."""
    if alone_in(group):
        source = flat[bounds[0][0] : bounds[0][1]]
        if out.data_ptr() != source.data_ptr() or out.numel() != source.numel():
            out.copy_(source)  # (with one device per node the slice is the bucket itself: nothing to copy)
        return None
    if _is_equal(bounds) and flat.numel() == bounds[-1][1]:
        reduce_scatter_flat = _flat_collective("reduce_scatter_single", "reduce_scatter_tensor")
        return reduce_scatter_flat(out, flat, group=group, async_op=async_op)
    return dist.reduce_scatter(
        out, [flat[start:end] for start, end in bounds], group=group, async_op=async_op
    )


def all_gather_slices(flat: torch.Tensor, bounds: Bounds, group: dist.ProcessGroup) -> list[dist.Work]:
    """Fill every slice of ``flat`` from its owner in ``group`` (in place); returns works to wait on."""
    if alone_in(group):
        return []
    if _is_equal(bounds) and flat.numel() == bounds[-1][1]:
        mine = bounds[dist.get_rank(group)]
        all_gather_flat = _flat_collective("all_gather_single", "all_gather_into_tensor")
        return [all_gather_flat(flat, flat[mine[0] : mine[1]], group=group, async_op=True)]
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
    works: list[dist.Work] = field(default_factory=list)  # what wait() still has to wait on
    error: BaseException | None = None
    # inter_node_dtype: what rounding to the narrower dtype left out of this slice last time (error
    # feedback; added to the next step's node sum), and what writes each piece's compressed sum back into
    # the slice once its collective is done
    residual: torch.Tensor | None = None
    decoders: list[Callable[[], None]] = field(default_factory=list)
    submitted_at: float = 0.0  # perf_counter() clock
    scatter_done_at: float = 0.0
    done_at: float = 0.0
    # on CUDA: an event on the gradients' stream at submit (what the side stream waits for), and one on the
    # side stream after the job's last operation (its completion, for timing and the compute stream's wait)
    ready_event: Any = None
    done_event: Any = None

    def mark_done(self) -> None:
        self.done_at = perf_counter()

    @torch.no_grad()
    def widen(self) -> None:
        """After the inter-node reduce: the narrow sums back into ``out`` (a no-op without compression)."""
        for decode in self.decoders:
            decode()
        self.decoders = []


Piece = tuple[list[tuple[int, int]] | None, tuple[int, int]]


class HierarchicalReducer:
    """Reduces :class:`ReduceJob` s in submission order: intra reduce-scatter, then inter all-reduce."""

    def __init__(
        self,
        intra_group: dist.ProcessGroup,
        inter_group: dist.ProcessGroup,
        chunk_bytes: int = 4 << 20,
        inter_dtype: torch.dtype | None = None,
        stream: HostStream | None = None,
    ) -> None:
        self.intra_group = intra_group
        self.inter_group = inter_group
        self.chunk_bytes = chunk_bytes
        self.inter_dtype = inter_dtype  # None: the inter-node hop in the gradients' own dtype
        self.stream = stream if stream is not None else HostStream()
        self._intra_size = dist.get_world_size(intra_group)
        self._intra_rank = dist.get_rank(intra_group)
        self._inter_size = dist.get_world_size(inter_group)

    def submit(self, job: ReduceJob) -> ReduceJob:
        raise NotImplementedError

    def wait(self, job: ReduceJob) -> torch.Tensor:
        """Until ``job`` is fully reduced (on CUDA: until the current stream is ordered after it); re-raises
        a communication error of the threaded reducer."""
        self._finish(job)
        self.stream.join(job.done_event)
        return job.out

    def wait_all(
        self, jobs: Sequence[ReduceJob], then: Callable[[int, ReduceJob], None] | None = None
    ) -> None:
        """Every job of a step reduced, then ``then(index, job)`` for each. On CUDA the current stream
        waits once, for the last job: the side stream runs the jobs in submission order, so its last
        event covers all of them. On the host ``then`` runs for each job as soon as it is done."""
        for index, job in enumerate(jobs):
            self._finish(job)
            if then is not None and not self.stream.on_device:
                then(index, job)
        if jobs:
            self.stream.join(jobs[-1].done_event)
        if then is not None and self.stream.on_device:
            for index, job in enumerate(jobs):
                then(index, job)

    def _finish(self, job: ReduceJob) -> None:
        """What ``wait`` does short of the current stream's wait: the host side of the job."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the reducer holds (nothing to do unless it runs a thread)."""

    def _settle_on_stream(self, job: ReduceJob) -> None:
        """Inside :meth:`HostStream.issuing` on a device: order the side stream after the job's
        collectives (``work.wait()`` there waits on the device, not the host), copy a narrowed sum back
        on it, and mark the job done. On the host the works stay for ``wait`` to block on."""
        if not self.stream.on_device:
            return
        for work in job.works:
            work.wait()
        job.works = []
        job.widen()
        job.done_event = self.stream.done_marker()

    def _pieces(self, job: ReduceJob) -> list[Piece]:
        """Cut a large bucket into chunks, each a piece of every slice, so chunk ``c``'s inter-node
        all-reduce overlaps chunk ``c+1``'s reduce-scatter inside one bucket too.

        Returns ``(input ranges per slice or None for the whole bucket, output range)`` pairs.
        """
        sizes = [end - start for start, end in job.bounds]
        chunk = max(1, self.chunk_bytes // job.flat.element_size())
        count = -(-max(sizes) // chunk) if max(sizes) > 0 else 1
        if count <= 1 or alone(self._intra_size):
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

    def _scatter_piece(self, job: ReduceJob, piece: Piece, async_op: bool) -> dist.Work | None:
        piece_bounds, (lo, hi) = piece
        out = job.out[lo:hi]
        if piece_bounds is None:
            return reduce_scatter_into(out, job.flat, job.bounds, self.intra_group, async_op=async_op)
        inputs = [job.flat[start:end] for start, end in piece_bounds]
        return dist.reduce_scatter(out, inputs, group=self.intra_group, async_op=async_op)

    def _all_reduce_piece(self, job: ReduceJob, piece: Piece) -> dist.Work | None:
        if alone(self._inter_size):
            return None
        lo, hi = piece[1]
        out = job.out[lo:hi]
        if not compresses(self.inter_dtype, out.dtype):
            return dist.all_reduce(out, group=self.inter_group, async_op=True)
        # int8 on gloo waits for its all-to-all here, so the next piece's reduce-scatter starts once the
        # all-gather is issued
        residual = job.residual[lo:hi] if job.residual is not None else None
        work, finish = start_compressed_all_reduce(out, residual, self.inter_dtype, self.inter_group)
        job.decoders.append(finish)
        return work


class InlineReducer(HierarchicalReducer):
    """Issues each job's collectives at ``submit``, from the calling thread (CUDA's reducer), on the
    reducer's side stream where there is one."""

    def submit(self, job: ReduceJob) -> ReduceJob:
        job.submitted_at = perf_counter()
        job.ready_event = self.stream.ready_marker()
        with self.stream.issuing(job.ready_event):
            self.stream.keep_alive(job.flat, job.out)
            for piece in self._pieces(job):
                scatter = self._scatter_piece(job, piece, async_op=True)
                reduce = None
                if not alone(self._inter_size):
                    if scatter is not None:
                        scatter.wait()  # NCCL: the side stream waits, backward goes on; gloo: blocks here
                    reduce = self._all_reduce_piece(job, piece)
                work = reduce if reduce is not None else scatter
                if work is not None:
                    job.works.append(work)
            self._settle_on_stream(job)
        job.scatter_done_at = perf_counter()
        job.scatter_done.set()
        return job

    def _finish(self, job: ReduceJob) -> None:
        for work in job.works:
            work.wait()
        job.works = []
        job.widen()
        job.done_at = perf_counter()


class _CommunicationThread(threading.Thread):
    """A :class:`ThreadedReducer`'s consumer. ``stop()`` ends it once the jobs queued before are done: what
    harnesses that clean up daemon threads call (Lightning's own test suite), e.g. when a step ran after
    ``teardown`` had closed the reducer; the reducer starts a new one at its next ``submit``."""

    def __init__(self, run: Callable[[queue.Queue], None], jobs: queue.Queue) -> None:
        super().__init__(target=run, args=(jobs,), name="lightning_hier-comm", daemon=True)
        self.jobs = jobs

    def stop(self, timeout: float = 5.0) -> None:
        self.jobs.put(None)
        self.join(timeout=timeout)


class ThreadedReducer(HierarchicalReducer):
    """Runs jobs in submission order on a background communication thread (gloo's reducer).

    One consumer, always: a thread that does not stop within ``close``'s timeout (a collective
    still running) keeps its own queue, and the next ``submit`` waits for it to finish before a
    new thread starts, so two threads never issue collectives at once.
    """

    def __init__(
        self,
        intra_group: dist.ProcessGroup,
        inter_group: dist.ProcessGroup,
        chunk_bytes: int = 4 << 20,
        inter_dtype: torch.dtype | None = None,
        stream: HostStream | None = None,
    ) -> None:
        super().__init__(intra_group, inter_group, chunk_bytes, inter_dtype, stream)
        self._jobs: queue.Queue[ReduceJob | None] = queue.Queue()
        self._thread: _CommunicationThread | None = None
        self._stopping: threading.Thread | None = None

    def submit(self, job: ReduceJob) -> ReduceJob:
        job.submitted_at = perf_counter()
        job.ready_event = self.stream.ready_marker()  # on the gradients' stream, before the thread issues
        if self._thread is not None and not self._thread.is_alive():  # stopped from outside (stop())
            self._thread = None
        if self._thread is None:
            if self._stopping is not None:
                self._stopping.join()  # the previous consumer first finishes what it is doing
                self._stopping = None
            self._jobs = queue.Queue()
            self._thread = _CommunicationThread(self._run, self._jobs)
            self._thread.start()
        self._jobs.put(job)
        return job

    def _finish(self, job: ReduceJob) -> None:
        job.scatter_done.wait()
        if job.error is not None:
            raise job.error
        for work in job.works:
            work.wait()
        job.works = []
        job.widen()
        job.done_at = max(job.done_at, job.scatter_done_at)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread; one still busy after ``timeout`` seconds finishes in the background."""
        if self._thread is None:
            return
        self._jobs.put(None)
        self._thread.join(timeout=timeout)
        if self._thread.is_alive():
            log.warning(
                "lightning_hier: the communication thread is still busy %.0f s after close(); a new one "
                "starts only once it has finished",
                timeout,
            )
            self._stopping = self._thread
        self._thread = None

    def _run(self, jobs: queue.Queue[ReduceJob | None]) -> None:
        self.stream.enter_thread()
        inter_running: dist.Work | None = None
        while True:
            job = jobs.get()
            if job is None:
                return
            try:
                with self.stream.issuing(job.ready_event):
                    self.stream.keep_alive(job.flat, job.out)
                    for piece in self._pieces(job):
                        self._scatter_piece(job, piece, async_op=False)
                        job.scatter_done_at = job.done_at = perf_counter()
                        # one inter-node all-reduce at a time: gloo runs a group's asynchronous collectives
                        # side by side on its worker threads, where on the slow link they only share it and
                        # the bucket ready first finishes later (the time-bucket benchmark's last two buckets,
                        # or all of them when the host is busy); the next piece's reduce-scatter above still
                        # overlaps it
                        if inter_running is not None:
                            inter_running.wait()
                        work = inter_running = self._all_reduce_piece(job, piece)
                        if work is not None:
                            work.get_future().add_done_callback(lambda _, job=job: job.mark_done())
                            job.works.append(work)
                    self._settle_on_stream(job)
            except BaseException as err:  # handed to the training thread in wait()
                job.error = err
            finally:
                job.scatter_done.set()


REDUCERS = ("auto", "inline", "thread")
CUDA_CHUNK_MB = 4.0
"""``comm_chunk_mb`` left ``None`` on CUDA: NCCL needs messages of megabytes to reach its bandwidth."""
HOST_CHUNK_MB = 1.0
"""``comm_chunk_mb`` left ``None`` on CPU: gloo's intra-node hop is slow enough that the first chunk's
reduce-scatter (before the slow link starts) and the last chunk's all-gather (after it ends) show; on the
emulated 2 x 2 cluster at 200 Mbit/s 1 MB chunks gave 0.677x ``ddp``'s step against 0.694x at 4 MB."""


def chunk_bytes_for(comm_chunk_mb: float | None, device: torch.device) -> int:
    """The pipelining chunk in bytes: ``comm_chunk_mb``, or where it is ``None`` the device's default
    (:data:`CUDA_CHUNK_MB` on CUDA or a CPU run emulating it, else :data:`HOST_CHUNK_MB`)."""
    if comm_chunk_mb is None:
        comm_chunk_mb = CUDA_CHUNK_MB if runs_as_cuda(device) else HOST_CHUNK_MB
    return max(1, int(comm_chunk_mb * 1024 * 1024))


def make_reducer(
    intra_group: dist.ProcessGroup,
    inter_group: dist.ProcessGroup,
    chunk_bytes: int,
    device: torch.device,
    kind: str = "auto",
    inter_dtype: torch.dtype | None = None,
) -> HierarchicalReducer:
    """``"auto"``: :class:`InlineReducer` on CUDA (or a CPU run emulating it), else the threaded one."""
    if kind not in REDUCERS:
        raise ValueError(f"reducer={kind!r} is not one of {list(REDUCERS)}.")
    if kind == "auto":
        kind = "inline" if runs_as_cuda(device) else "thread"
    cls = InlineReducer if kind == "inline" else ThreadedReducer
    return cls(intra_group, inter_group, chunk_bytes, inter_dtype, stream=comm_stream_for(device))
