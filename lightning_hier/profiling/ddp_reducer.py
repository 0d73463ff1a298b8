"""``ddp``'s gradient all-reduces, read from DDP's own runtime statistics instead of a comm hook.

DDP's C++ reducer all-reduces the gradient buckets out of Python's sight, but it times them itself
(host clock on CPU, CUDA events on GPU) and keeps the result in its logging data: the span from the
first bucket's launch to the last one's completion (``backward_comm_time``), the part of that span
during which backward was still computing (``backward_compute_comm_overlap_time``), the buckets
reduced and their sizes. :class:`DDPReducerStats` asks for those numbers after each synchronising
backward (DDP's sampling set as below while it is attached) and turns them into the profiler's
:class:`~lightning_hier.profiling.comm_stats.KindStats`. DDP keeps its own C++ all-reduce, so the
profiler costs nothing there (a Python comm hook cost ~3 % on CPU and more on a GPU), and a user's
comm hook stays in place (its time is DDP's communication time; bytes are the buckets' sizes, what
the default all-reduce sends).

On CUDA DDP's timer waits for its events (``cudaEventSynchronize``) whenever it records an iteration,
which stalls the host that would otherwise run a step ahead of the device: sampling every iteration cost
18-33 % of an 8 x 4096 MLP's step on an H100. So on CUDA the time is DDP's sample of every
``timing_every``-th synchronising iteration (and of the first ten, which DDP always samples), and the
iterations in between carry the latest sample; counts and bytes are exact every iteration. On CPU the
timer reads the host clock and every iteration is timed. Between samples the numbers are not read again:
DDP's logging data costs about 0.13 ms per read on an H200's host (a C++ struct turned into a dict), and the
bucket sizes are fixed once DDP has rebuilt its buckets (in its first iterations, which are always read).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch.distributed as dist

from lightning_hier.profiling.comm_stats import KindStats

NS = 1e-9


def _ints(text: Any) -> list[int]:
    """DDP logs bucket sizes as ``"1050624, 1050624"``."""
    return [int(part) for part in str(text).split(",") if part.strip()]


class DDPReducerStats:
    """Per synchronising backward of one ``DistributedDataParallel`` model: count, bytes, time, exposed.

    ``timing_every``: DDP's sampling rate for the time (``None``: every iteration on CPU, every 20th on
    CUDA, where a sample stalls the host)."""

    CUDA_TIMING_EVERY = 20
    ALWAYS_SAMPLED = 10  # torch's DDP records its first ten iterations whatever the sample rate

    def __init__(self, model: Any, timing_every: int | None = None) -> None:
        self.model = model
        self.world_size = dist.get_world_size(model.process_group) if dist.is_initialized() else 1
        on_cuda = any(p.is_cuda for p in model.parameters())
        if timing_every is None:
            timing_every = self.CUDA_TIMING_EVERY if on_cuda else 1
        if timing_every < 1:
            raise ValueError(f"timing_every must be >= 1, got {timing_every!r}.")
        self.timing_every = timing_every  # as resolved: what it sets DDP's sampling to
        # DDP's default samples one iteration in 100 (after the first 10)
        model._set_ddp_runtime_logging_sample_rate(timing_every)
        self._sampled_iteration: int | None = None
        self._reads = 0  # synchronising backwards read since attach: DDP's iteration count from its start
        self._latest: KindStats | None = None
        self._comm_s = 0.0
        self._hidden_s = 0.0

    @staticmethod
    def attach(strategy: Any, timing_every: int | None = None) -> DDPReducerStats | None:
        """The statistics of ``strategy.model`` when it is a ``DistributedDataParallel``, else ``None``."""
        from torch.nn.parallel import DistributedDataParallel

        model = getattr(strategy, "model", None)
        if not isinstance(model, DistributedDataParallel):
            return None
        return DDPReducerStats(model, timing_every)

    @property
    def synchronizing(self) -> bool:
        """Whether the backward running now reduces (``False`` inside ``no_sync``: accumulation)."""
        return bool(self.model.require_backward_grad_sync)

    def read(self) -> KindStats:
        """The all-reduces of the synchronising backward that ran last (after it has finished); its time is
        the latest sample's where DDP did not sample this iteration."""
        self._reads += 1
        # DDP samples its first ALWAYS_SAMPLED iterations and then every timing_every-th; in between the
        # latest sample stands, so nothing is read. (A DDP model that had iterated before the profiler was
        # attached samples off this count: its sample is then read a few steps late, never lost.)
        sampled_now = self._reads <= self.ALWAYS_SAMPLED or self._reads % self.timing_every == 0
        if self._latest is not None and not sampled_now:
            return replace(self._latest)
        # DDP does this itself at the next forward; a no-op (no wait) on an iteration it does not sample
        self.model.logger.set_runtime_stats_and_log()
        data = self.model._get_ddp_logging_data()
        sizes = _ints(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", ""))
        nbytes = sum(sizes)
        sampled = data.get("iteration")
        if sampled != self._sampled_iteration:
            self._sampled_iteration = sampled
            self._comm_s = max(0.0, data.get("backward_comm_time", 0) * NS)
            overlap_s = max(0.0, data.get("backward_compute_comm_overlap_time", 0) * NS)
            self._hidden_s = min(self._comm_s, overlap_s)
        wire = int(nbytes * 2 * (self.world_size - 1) / self.world_size) if self.world_size > 1 else 0
        self._latest = KindStats(
            count=len(sizes),
            nbytes=nbytes,
            wire_bytes=wire,
            time_s=self._comm_s,
            exposed_s=self._comm_s - self._hidden_s,
        )
        return replace(self._latest)
