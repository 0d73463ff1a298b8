"""Validated settings of ``hier_bsp``: how long a superstep lasts and how stale a gradient may be."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BSPSettings:
    """When supersteps close and how far a worker may run ahead; invalid values raise at construction.

    Exactly one of:

    - ``superstep_steps=N``: a superstep closes once the workers together have folded ``N`` micro-steps
      each on average (``N x world_size`` in total), whoever computed them;
    - ``superstep_seconds=T``: a superstep closes ``T`` seconds after it opened (on the controller's
      clock, global rank 0), once at least one micro-step was folded.

    ``max_staleness=S``: no gradient is applied more than ``S`` supersteps after the model it was
    computed from was announced; a worker that has folded ``(S + 1) x N`` micro-steps into the open
    superstep waits for the next model. ``S = 0`` with ``N`` micro-steps is bulk-synchronous: every
    worker folds exactly ``N`` per superstep (``N = 1``: Lightning's ``ddp``).
    """

    superstep_steps: int | None = 4
    superstep_seconds: float | None = None
    max_staleness: int = 1

    def __post_init__(self) -> None:
        steps, seconds = self.superstep_steps, self.superstep_seconds
        if (steps is None) == (seconds is None):
            raise ValueError(
                "hier_bsp needs exactly one of superstep_steps and superstep_seconds, got "
                f"superstep_steps={steps!r} and superstep_seconds={seconds!r}."
            )
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"superstep_steps must be a positive integer, got {steps!r}.")
        if seconds is not None and (
            isinstance(seconds, bool)
            or not isinstance(seconds, (int, float))
            or not math.isfinite(seconds)
            or seconds <= 0
        ):
            raise ValueError(f"superstep_seconds must be a positive number of seconds, got {seconds!r}.")
        staleness = self.max_staleness
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"max_staleness must be an integer >= 0, got {staleness!r}.")

    @property
    def lockstep(self) -> bool:
        """Whether every worker takes the same number of micro-steps per superstep (``max_staleness=0``
        with ``superstep_steps``). Otherwise a faster worker takes more, so workers reach a given step
        number at different times and run out of a fixed share of batches at different times."""
        return self.max_staleness == 0 and self.superstep_steps is not None

    @property
    def quota(self) -> int | None:
        """Micro-steps a worker may fold into one superstep before it waits (``None``: no count limit)."""
        if self.superstep_steps is None:
            return None
        return (self.max_staleness + 1) * self.superstep_steps
