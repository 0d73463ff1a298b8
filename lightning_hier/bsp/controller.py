"""The central BSP controller's decisions: when a superstep closes and when the job pauses.

Every tick, each rank's local BSP module contributes one status row (what its worker has folded, what
it is computing from, whether it can start another micro-step) to an all-gather on a CPU group. The
controller role belongs to global rank 0: its row carries its clock (``superstep_seconds``), and the
rules below turn the gathered rows into a decision. Every rank holds the same rows, so every rank
evaluates the same pure function and reaches rank 0's decision without another broadcast: one decision
from identical inputs, so every rank issues its collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_hier.bsp.settings import BSPSettings

# columns of a status row
FOLDED = 0  # micro-steps folded into the open superstep
INFLIGHT = 1  # model version the worker computes from now; -1 between micro-steps
BLOCKED = 2  # 1: the worker cannot start another micro-step before the next model (or a resume)
DRAIN = 3  # 1: the worker stopped and asks for everything to be applied (epoch end, checkpoint, exit)
DEADLINE = 4  # rank 0 only: 1 once superstep_seconds have passed since the superstep opened
EPOCH_END = 5  # 1: the worker ran out of batches (every worker then ends its epoch)
STUCK = 6  # 1: blocked even with the newest model picked up (drained, or at its quota since that model)
READY = 7  # in the worker's last micro-step of a plain-BSP superstep: buckets folded so far; else -1
STEP_MS = 8  # the worker's recent micro-step cycle (start to next start, waits excluded), ms; 0 unknown
BUSY_MS = 9  # of that, from its start to its fold (forward, backward, hooks), ms; 0 unknown
ELAPSED_MS = 10  # ms since the worker's current cycle started; -1 while it waits or is unknown
ABORT = 11  # 1: the worker's training raised; every local module stops after this tick, none drains
FIT_END = 12  # 1: the worker reached the Trainer's max_steps (every worker then ends the fit)
ROW = 13


@dataclass(frozen=True)
class TickDecision:
    """What all ranks do after a tick.

    ``close``: read out, push, step, pull, announce the next model. ``closing``: a close is due but
    must wait for a worker whose micro-step would otherwise land too stale; with ``max_staleness=0``
    workers stop starting micro-steps until it happens. ``pause``: every worker drained (after the
    close, if any): the local modules stop ticking until their workers resume.
    """

    close: bool = False
    closing: bool = False
    pause: bool = False


def decide(rows: Sequence[Sequence[int]], settings: BSPSettings, version: int) -> TickDecision:
    """The decision for one tick; ``version`` is the newest announced model (the number of closes)."""
    folded = sum(row[FOLDED] for row in rows)
    if all(row[DRAIN] for row in rows):
        # every worker is inside its drain, so none computes. One inside an accumulation window
        # (validation in the middle of one) keeps its micro-step in flight until after the drain; the
        # close then waits for that fold unless closing now keeps its gradient within max_staleness
        # (otherwise the drain would wait for a fold that only the draining worker itself could make)
        in_flight = any(row[INFLIGHT] >= 0 for row in rows)
        close = folded > 0 and (not in_flight or safe_to_close(rows, version, settings.max_staleness))
        return TickDecision(close=close, pause=True)
    if settings.fill_idle:  # every worker folded its share; the faster ones may have folded more
        due = all(row[FOLDED] >= settings.superstep_steps for row in rows)
    elif settings.superstep_steps is not None:
        due = folded >= settings.superstep_steps * len(rows)
    else:
        due = bool(rows[0][DEADLINE]) and folded > 0
    # no worker can fold more before a new model (some drained, e.g. their epoch ended first, and the
    # rest reached their quota since picking up the newest one): the superstep cannot fill up, so it
    # closes with what it has. BLOCKED alone is not enough: a worker that has not yet picked up the
    # newest model reads as blocked but will fold again once it does.
    due = due or (folded > 0 and all(row[STUCK] for row in rows))
    if not due:
        return TickDecision()
    if safe_to_close(rows, version, settings.max_staleness):
        return TickDecision(close=True)
    return TickDecision(closing=True)


def safe_to_close(rows: Sequence[Sequence[int]], version: int, max_staleness: int) -> bool:
    """Whether closing now keeps every gradient within ``max_staleness``.

    The close makes model ``version + 1``; a micro-step computed from model ``r`` that is not folded
    by then lands in the superstep after, ``version + 1 - r`` supersteps after its model. A worker
    that is between micro-steps and not blocked may start one from ``version`` right after its row
    was taken, so it counts as computing from ``version``.
    """
    for row in rows:
        if row[INFLIGHT] >= 0:
            source = row[INFLIGHT]
        elif not row[BLOCKED]:
            source = version
        else:
            continue
        if version + 1 - source > max_staleness:
            return False
    return True


# a worker fills only while waiting for one whose recent steps take at least this much longer than its
# own: equally fast workers differ by jitter from step to step, and filling then would only enlarge
# supersteps that ddp would not have enlarged
FILL_SLOWER = 1.5


def slowest_remaining_s(
    rows: Sequence[Sequence[int]], settings: BSPSettings, version: int, own_step_ms: int
) -> float:
    """How long, in seconds from when ``rows`` were taken, until the slowest straggler that still owes
    micro-steps from model ``version`` folds its next one (``fill_idle``); 0 when there is none or a
    time is not known yet. A straggler's cycle takes at least ``FILL_SLOWER`` x ``own_step_ms``.

    From a worker's own times: in a micro-step, its fold is ``BUSY - ELAPSED`` away; between two (its
    slow part may be outside the step: data loading, a hook), its next start is ``STEP - ELAPSED``
    away and its fold ``BUSY`` after that. A worker at its quota may start another micro-step from the
    same model if it expects to fold it within this: the superstep cannot close before then anyway.
    """
    owed = settings.superstep_steps or 0
    if own_step_ms <= 0:
        return 0.0
    remaining_ms = [
        row[BUSY_MS] - row[ELAPSED_MS]
        if row[INFLIGHT] >= 0
        else max(row[STEP_MS] - row[ELAPSED_MS], 0) + row[BUSY_MS]
        for row in rows
        if row[FOLDED] < owed
        and row[INFLIGHT] in (version, -1)
        and not (row[STUCK] or row[DRAIN])  # BLOCKED alone: it has not picked up the newest model yet
        and row[STEP_MS] >= FILL_SLOWER * own_step_ms
        and row[BUSY_MS] > 0
        and row[ELAPSED_MS] >= 0
    ]
    return max(max(remaining_ms, default=0), 0) / 1000.0
