"""The aggregated gradient of one worker: every micro-step's gradient summed the moment it exists.

A worker folds each micro-step's flat gradients into running sums and counts the micro-steps (and
remembers which model version each was computed from). At a superstep the local BSP module reads the
sums out (the worker keeps folding into a fresh set) and pushes them; the parameter server divides
the job-wide sum by the job-wide micro-step count, so a worker that did more micro-steps weighs more,
and a superstep of one micro-step per worker is exactly data parallel averaging.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class ReadOut:
    """What one worker contributes to a superstep."""

    sums: list[torch.Tensor]
    count: int
    versions: list[int]  # the model version each folded micro-step was computed from
    used: list[int] = field(default_factory=list)  # per parameter: 1 if a micro-step gave it a gradient

    def staleness(self, applied_at: int) -> list[int]:
        """Supersteps between each micro-step's model and the superstep ``applied_at`` that applies it
        (0: computed from the newest model when the superstep opened)."""
        return [applied_at - 1 - version for version in self.versions]


class GradientAggregate:
    """Double-buffered gradient sums shaped like ``like`` (one flat tensor per bucket)."""

    def __init__(self, like: Sequence[torch.Tensor], num_params: int = 0) -> None:
        self._sums = [torch.zeros_like(t) for t in like]
        self._spare = [torch.zeros_like(t) for t in like]
        self.count = 0
        self.versions: list[int] = []
        self.num_params = num_params
        self.used = [0] * num_params

    @property
    def sums(self) -> list[torch.Tensor]:
        """The running sums being folded into (what the next :meth:`read_out` hands over)."""
        return self._sums

    @torch.no_grad()
    def fold_bucket(self, index: int, grad: torch.Tensor) -> None:
        """Add bucket ``index`` of a micro-step ahead of the rest (:meth:`fold` with ``folded`` then
        skips it); the micro-step counts once, at :meth:`fold`."""
        self._sums[index].add_(grad)

    @torch.no_grad()
    def fold(
        self,
        grads: Sequence[torch.Tensor],
        version: int,
        used: Sequence[bool] | None = None,
        folded: int = 0,
    ) -> None:
        """Add one micro-step's gradients, computed from model ``version``; ``used``: which parameters
        got a gradient in it (``None``: all); ``folded``: its first buckets, already added by
        :meth:`fold_bucket`."""
        for index, (total, grad) in enumerate(zip(self._sums, grads, strict=True)):
            if index >= folded:
                total.add_(grad)
        self.count += 1
        self.versions.append(version)
        if used is None:
            self.used = [1] * self.num_params
        else:
            self.used = [int(a or b) for a, b in zip(self.used, used, strict=True)]

    def read_out(self) -> ReadOut:
        """Everything folded so far; folding goes on into zeroed buffers. Hand the sums back with
        :meth:`recycle` once they are pushed."""
        out = ReadOut(self._sums, self.count, self.versions, self.used)
        self._sums, self._spare = self._spare, []
        self.count, self.versions, self.used = 0, [], [0] * self.num_params
        return out

    @torch.no_grad()
    def recycle(self, out: ReadOut) -> None:
        """Take pushed sums back as the next spare buffers."""
        for tensor in out.sums:
            tensor.zero_()
        self._spare = out.sums
