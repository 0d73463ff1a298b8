"""Broadcasts that their source posts without waiting for the receivers.

On gloo a send completes only once its receiver has posted the receive, so a source that waits for its
broadcast waits until the slowest receiver gets there. A source that already holds the value it sends has
no reason to: it posts the broadcast here, keeps the tensor alive, and waits for completion later (before
its next one, or at teardown)."""

from __future__ import annotations

import torch
import torch.distributed as dist


class PostedBroadcasts:
    """The broadcasts this rank sourced and has not yet waited for."""

    def __init__(self) -> None:
        self._in_flight: list[tuple[dist.Work, torch.Tensor]] = []

    def post(self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
        """Broadcast ``tensor`` from this rank (``src``) without waiting; ``tensor`` is kept until done."""
        self._in_flight.append((dist.broadcast(tensor, src=src, group=group, async_op=True), tensor))

    def wait(self) -> None:
        """Until every posted broadcast has reached every receiver."""
        in_flight, self._in_flight = self._in_flight, []
        for work, _ in in_flight:
            work.wait()

    def forget(self) -> None:
        """Drop the posted broadcasts unwaited (after a failure, when the receivers may be gone)."""
        self._in_flight = []
