"""Module buffers from one rank to the others at the forwards where Lightning's ``ddp`` sends them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_hier.sliced.comm_stream import HostStream, comm_stream_for


class RootBuffers:
    """The ``source`` rank's buffers (BatchNorm's running statistics and the like) on every rank of ``group``,
    where and as ``ddp`` (``broadcast_buffers=True``) gives every rank rank 0's: before the first forward of a
    fit, and before the forward (training or, while fitting, validation) that follows a training step whose
    backward synchronised the gradients; never after an accumulating step or a validation forward. So every
    rank evaluates with the source's statistics, and a checkpoint (the source's) holds what ``ddp``'s holds.
    ``hier_sliced`` uses it over all ranks from rank 0, ``hier_pipeline`` over each stage's replicas from
    replica 0's.

    Collective over ``group``, with the same list of buffers on each rank: one broadcast per dtype (a flat
    copy), issued on the communication stream on CUDA, which the compute stream waits for without a host
    wait."""

    def __init__(self, source: int, group: Any, device: torch.device) -> None:
        self.source = source
        self.group = group
        self.device = device
        self.due = True  # ddp's require_forward_param_sync: a new wrapper (each fit) starts with it set
        self.broadcasts = 0
        self._stream: HostStream | None = None

    def before_forward(self, buffers: Sequence[torch.Tensor], synchronises: bool) -> None:
        """Before a step's first forward: the source's ``buffers`` if due. ``synchronises``: whether this
        step's backward averages the gradients (a training step ending its accumulation window), which makes
        the next forward receive them."""
        if self.due:
            self.broadcast(buffers)
        self.due = synchronises

    def new_fit(self) -> None:
        """Start a new fit: the next :meth:`before_forward` broadcasts the source's buffers, as ``ddp``'s new
        wrapper of each fit does, whatever the last step of an earlier fit left due."""
        self.due = True

    @torch.no_grad()
    def broadcast(self, buffers: Sequence[torch.Tensor]) -> None:
        """The source's values of ``buffers`` on every rank of the group (collective over it)."""
        if self._stream is None:
            self._stream = comm_stream_for(self.device)
        stream = self._stream
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for buffer in buffers:
            if buffer.numel():
                groups.setdefault((buffer.dtype, buffer.device), []).append(buffer)
        done = None
        flats = []
        for same in groups.values():
            flat = torch.cat([b.reshape(-1) for b in same])
            with stream.issuing(stream.ready_marker()):
                stream.keep_alive(flat)
                dist.broadcast(flat, src=self.source, group=self.group)
                done = stream.done_marker()
            flats.append(flat)
        stream.join(done)
        for same, flat in zip(groups.values(), flats):
            views = [part.view_as(b) for part, b in zip(flat.split([b.numel() for b in same]), same)]
            torch._foreach_copy_(same, views)
        self.broadcasts += 1
