"""Validated settings of ``hier_bsp``: how long a superstep lasts and how stale a gradient may be."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

GRADIENT_AVERAGES = ("folded", "nominal")
SUPERSTEP_UNITS = {"ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}
_DURATION = re.compile(r"\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(ms|s|min|h)\s*")


def parse_superstep(superstep: int | str | timedelta) -> tuple[int | None, float | None]:
    """``(steps, seconds)`` of a ``superstep`` setting, one of them ``None``: an ``int`` is a step count, a
    ``datetime.timedelta`` or a string with a unit (``"500ms"``, ``"2s"``, ``"1.5min"``, ``"1h"``) a duration.
    Anything else raises ``ValueError`` naming the setting, the value and the valid forms."""
    if isinstance(superstep, int) and not isinstance(superstep, bool):
        if superstep >= 1:
            return superstep, None
    elif isinstance(superstep, timedelta):
        if superstep.total_seconds() > 0:
            return None, superstep.total_seconds()
    elif isinstance(superstep, str):
        match = _DURATION.fullmatch(superstep)
        seconds = float(match.group(1)) * SUPERSTEP_UNITS[match.group(2)] if match else math.nan
        if 0 < seconds < math.inf:
            return None, seconds
    ambiguous = isinstance(superstep, float)
    hint = f" (a bare number is ambiguous: for seconds write '{superstep}s')" if ambiguous else ""
    raise ValueError(
        f"superstep={superstep!r} is not valid{hint}: give a step count as a positive int (superstep=4) or "
        "a positive duration as a datetime.timedelta or a string with a unit, ms, s, min or h "
        "(superstep='500ms')."
    )


@dataclass(frozen=True)
class BSPSettings:
    """When supersteps close and how far a worker may run ahead; invalid values raise at construction.

    ``superstep``, one of:

    - a step count ``N`` (an ``int``): a superstep closes once the workers together have folded ``N``
      micro-steps each on average (``N x world_size`` in total), whoever computed them;
    - a duration ``T`` (a ``datetime.timedelta`` or a string with a unit: ``"500ms"``, ``"2s"``,
      ``"1.5min"``, ``"1h"``): a superstep closes ``T`` after it opened (on the controller's clock, global
      rank 0), once at least one micro-step was folded.

    ``max_staleness=S``: no gradient is applied more than ``S`` supersteps after the model it was
    computed from was announced; a worker that has folded ``(S + 1) x N`` micro-steps into the open
    superstep waits for the next model. ``S = 0`` with ``N`` micro-steps is bulk-synchronous: every
    worker folds exactly ``N`` per superstep (``N = 1``: Lightning's ``ddp``).

    ``fill_idle=F`` (``max_staleness=0`` with a step count only): a worker at its quota that would
    otherwise wait for a slower worker's micro-step computes up to ``F`` more from the same model, each
    when it expects to finish before that slower worker does (from the step times in the status rows).
    No gradient gets stale and equally fast workers still fold ``N`` each, but a straggler no longer
    idles the others.

    ``gradient_average``: ``"folded"`` divides a superstep's gradient sum by the micro-steps folded into
    it (the mean per micro-step); ``"nominal"`` by ``N x world_size``, so every micro-step weighs what
    one worker's step weighs in ``ddp`` and a superstep that holds more micro-steps (``fill_idle``)
    takes a proportionally larger step, as that many ``ddp`` steps would.

    ``superstep_steps`` and ``superstep_seconds`` are ``superstep`` read as a step count or as seconds
    (the other one ``None``).
    """

    superstep: int | str | timedelta = 4
    max_staleness: int = 1
    fill_idle: int = 0
    gradient_average: Literal["folded", "nominal"] = "folded"
    superstep_steps: int | None = field(init=False, repr=False, compare=False)
    superstep_seconds: float | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        steps, seconds = parse_superstep(self.superstep)
        object.__setattr__(self, "superstep_steps", steps)
        object.__setattr__(self, "superstep_seconds", seconds)
        staleness = self.max_staleness
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"max_staleness must be an integer >= 0, got {staleness!r}.")
        fill = self.fill_idle
        if isinstance(fill, bool) or not isinstance(fill, int) or fill < 0:
            raise ValueError(f"fill_idle must be an integer >= 0 (extra micro-steps), got {fill!r}.")
        if fill and (staleness != 0 or steps is None):
            raise ValueError(
                "fill_idle needs max_staleness=0 and a superstep of a step count (with max_staleness >= 1 or "
                "a superstep of a duration, faster workers already go on without waiting), got "
                f"max_staleness={staleness!r} and superstep={self.superstep!r}."
            )
        if self.gradient_average not in GRADIENT_AVERAGES:
            raise ValueError(
                f"gradient_average must be one of {GRADIENT_AVERAGES}, got {self.gradient_average!r}."
            )
        if self.gradient_average == "nominal" and steps is None:
            raise ValueError(
                "gradient_average='nominal' divides by the superstep's step count x world_size and needs a "
                f"superstep of a step count, got superstep={self.superstep!r}; with a duration use 'folded'."
            )

    @property
    def lockstep(self) -> bool:
        """Whether every worker takes the same number of micro-steps per superstep (``max_staleness=0``
        with a step count and no ``fill_idle``). Otherwise a faster worker takes more, so workers reach a
        given step number, and the end of a fixed share of batches, at different times."""
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
