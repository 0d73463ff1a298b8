"""Validated settings of ``hier_bsp``: how long a superstep lasts and how stale a gradient may be."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

GRADIENT_AVERAGES = ("folded", "nominal")


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

    ``fill_idle=F`` (``max_staleness=0`` with ``superstep_steps`` only): a worker at its quota that would
    otherwise wait for a slower worker's micro-step computes up to ``F`` more from the same model, each
    when it expects to finish before that slower worker does (from the step times in the status rows).
    No gradient gets stale and equally fast workers still fold ``N`` each, but a straggler no longer
    idles the others.

    ``gradient_average``: ``"folded"`` divides a superstep's gradient sum by the micro-steps folded into
    it (the mean per micro-step); ``"nominal"`` by ``N x world_size``, so every micro-step weighs what
    one worker's step weighs in ``ddp`` and a superstep that holds more micro-steps (``fill_idle``)
    takes a proportionally larger step, as that many ``ddp`` steps would.
    """

    superstep_steps: int | None = 4
    superstep_seconds: float | None = None
    max_staleness: int = 1
    fill_idle: int = 0
    gradient_average: Literal["folded", "nominal"] = "folded"

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
        fill = self.fill_idle
        if isinstance(fill, bool) or not isinstance(fill, int) or fill < 0:
            raise ValueError(f"fill_idle must be an integer >= 0 (extra micro-steps), got {fill!r}.")
        if fill and (staleness != 0 or steps is None):
            raise ValueError(
                "fill_idle needs max_staleness=0 and superstep_steps (with max_staleness >= 1 or "
                "superstep_seconds, faster workers already go on without waiting), got "
                f"max_staleness={staleness!r} and superstep_steps={steps!r}."
            )
        if self.gradient_average not in GRADIENT_AVERAGES:
            raise ValueError(
                f"gradient_average must be one of {GRADIENT_AVERAGES}, got {self.gradient_average!r}."
            )
        if self.gradient_average == "nominal" and steps is None:
            raise ValueError(
                "gradient_average='nominal' divides by superstep_steps x world_size and needs "
                "superstep_steps; with superstep_seconds use 'folded'."
            )

    @property
    def lockstep(self) -> bool:
        """Whether every worker takes the same number of micro-steps per superstep (``max_staleness=0``
        with ``superstep_steps`` and no ``fill_idle``). Otherwise a faster worker takes more, so workers
        reach a given step number, and the end of a fixed share of batches, at different times."""
        return self.max_staleness == 0 and self.superstep_steps is not None and self.fill_idle == 0

    def gradient_divisor(self, folded: int, world_size: int) -> int:
        """What a superstep's job-wide gradient sum of ``folded`` micro-steps is divided by."""
        if folded < 1:
            raise ValueError(f"a superstep needs at least one micro-step, got {folded}.")
        if self.gradient_average == "nominal":
            assert self.superstep_steps is not None
            return self.superstep_steps * world_size
        return folded

    @property
    def quota(self) -> int | None:
        """Micro-steps a worker may fold into one superstep before it waits (``None``: no count limit)."""
        if self.superstep_steps is None:
            return None
        return (self.max_staleness + 1) * self.superstep_steps
