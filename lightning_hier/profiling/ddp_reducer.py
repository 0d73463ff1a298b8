"""``ddp``'s gradient all-reduces, read from DDP's own runtime statistics instead of a comm hook.

DDP's C++ reducer all-reduces the gradient buckets out of Python's sight, but it times them itself
(host clock on CPU, CUDA events on GPU) and keeps the result in its logging data: the span from the
first bucket's launch to the last one's completion (``backward_comm_time``), the part of that span
during which backward was still computing (``backward_compute_comm_overlap_time``), the buckets
reduced and their sizes. :class:`DDPReducerStats` asks for those numbers after each synchronising
backward (DDP samples every iteration while it is attached) and turns them into the profiler's
:class:`~lightning_hier.profiling.comm_stats.KindStats`. DDP keeps its own C++ all-reduce, so the
profiler costs nothing there (a Python comm hook cost ~3 % on CPU and more on a GPU), and a user's
comm hook stays in place (its time is DDP's communication time; bytes are the buckets' sizes, what
the default all-reduce sends).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from lightning_hier.profiling.comm_stats import KindStats

NS = 1e-9


def _ints(text: Any) -> list[int]:
    """DDP logs bucket sizes as ``"1050624, 1050624"``."""
    return [int(part) for part in str(text).split(",") if part.strip()]


class DDPReducerStats:
    """Per synchronising backward of one ``DistributedDataParallel`` model: count, bytes, time, exposed."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.world_size = dist.get_world_size(model.process_group) if dist.is_initialized() else 1
        # runtime statistics every iteration (DDP's default samples one in 100, after the first 10)
        model._set_ddp_runtime_logging_sample_rate(1)

    @staticmethod
    def attach(strategy: Any) -> DDPReducerStats | None:
        """The statistics of ``strategy.model`` when it is a ``DistributedDataParallel``, else ``None``."""
        from torch.nn.parallel import DistributedDataParallel

        model = getattr(strategy, "model", None)
        return DDPReducerStats(model) if isinstance(model, DistributedDataParallel) else None

    @property
    def synchronizing(self) -> bool:
        """Whether the backward running now reduces (``False`` inside ``no_sync``: accumulation)."""
        return bool(self.model.require_backward_grad_sync)

    def read(self) -> KindStats:
        """The all-reduces of the synchronising backward that ran last (after it has finished)."""
        self.model.logger.set_runtime_stats_and_log()  # DDP does this itself at the next forward
        data = self.model._get_ddp_logging_data()
        sizes = _ints(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", ""))
        nbytes = sum(sizes)
        comm_s = max(0.0, data.get("backward_comm_time", 0) * NS)
        hidden_s = min(comm_s, max(0.0, data.get("backward_compute_comm_overlap_time", 0) * NS))
        wire = int(nbytes * 2 * (self.world_size - 1) / self.world_size) if self.world_size > 1 else 0
        return KindStats(
            count=int(data.get("num_buckets_reduced", len(sizes))),
            nbytes=nbytes,
            wire_bytes=wire,
            time_s=comm_s,
            exposed_s=comm_s - hidden_s,
        )
