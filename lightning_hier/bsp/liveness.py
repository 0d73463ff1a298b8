"""Which ranks are gone, for the BSP module and the worker waiting on it.

The heartbeats and the question after a failure are :mod:`lightning_hier.liveness` (every strategy's):
each rank bumps a counter in the job's key-value store once a second from a thread of its own, and after
a failure the counters that did not move for a few seconds name the lost ranks. The BSP module beats under
a key of its own run, on the strategy's heartbeat thread where that one beats already.

Under NCCL a collective whose peer died need not fail at all: the BSP thread waits on the device until
NCCL's watchdog ends the process at the groups' timeout, with a message that names no rank.
:class:`PeerWatch` covers that case from the worker's side: while the worker waits on its local BSP
module, it compares the counters every few seconds and names a rank whose beat stopped, well before
that timeout.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from lightning_hier import liveness
from lightning_hier.liveness import BEAT_SECONDS, WATCH_SECONDS, lost_ranks  # noqa: F401 - bsp's names
from lightning_hier.liveness import beats as _beats
from lightning_hier.liveness import from_communication as _from_communication
from lightning_hier.liveness import stopped as _stopped

# a waiting worker's check for stopped beats: this often, and at most a sixth of the groups' timeout, so
# that two checks (what naming a rank takes) fit well inside it
PEER_CHECK_SECONDS = 10.0


def new_run_key() -> str:
    """A prefix the same on every rank (every rank creates its BSP engines in the same order)."""
    return liveness.new_run_key("bsp")


class Heartbeat(liveness.Heartbeat):
    """A BSP module's heartbeat (:class:`lightning_hier.liveness.Heartbeat`): where the strategy's own
    heartbeat already beats for this process, that thread beats this counter too."""

    def __init__(self, run_key: str, rank: int) -> None:
        super().__init__(run_key, rank, name=f"hier-bsp-heartbeat-rank{rank}")


def peer_check_seconds(timeout_s: float) -> float:
    """How often a waiting worker compares the counters: :data:`PEER_CHECK_SECONDS`, at most a sixth of
    the groups' ``timeout_s``, and never under three beats (a live rank beats at least twice between)."""
    return max(3 * BEAT_SECONDS, min(PEER_CHECK_SECONDS, timeout_s / 6))


class PeerWatch:
    """The lost ranks, for a worker waiting on its local BSP module (main thread, no sleeping).

    Each :meth:`check` samples every rank's counter; a rank whose counter did not move since the previous
    sample, taken about ``every_s`` (up to three times that) before, and that did not leave in order, is
    lost. The worker calls it after each ``every_s`` of waiting without news, so it costs nothing while
    the local module keeps up, and two silent periods name a dead peer."""

    def __init__(self, run_key: str, world_size: int, every_s: float) -> None:
        self.run_key = run_key
        self.world_size = world_size
        self.every_s = every_s
        self._sample: tuple[float, list[int]] | None = None

    def check(self) -> list[int] | None:
        """Ranks found lost (``[]``: none, or no earlier sample to compare with yet); ``None`` when the
        store is unreachable (the process hosting it, normally global rank 0's, is gone)."""
        # every store call bounded (liveness.bounded): the worker's main thread runs this, and a store whose
        # host is cut off (not closed) would hold it for the store's own timeout, the job's, with no name
        try:
            store = dist.distributed_c10d._get_default_store()
            now = time.monotonic()
            beats = liveness.bounded(lambda: _beats(store, self.run_key, self.world_size))
            previous, self._sample = self._sample, (now, beats)
            if previous is None or not 0.9 * self.every_s <= now - previous[0] <= 3 * self.every_s:
                return []  # too close to tell a live rank from a lost one, or from an earlier wait
            return liveness.bounded(lambda: _stopped(store, self.run_key, previous[1], beats))
        except Exception:  # noqa: BLE001 - any store failure (or silence) means its host is unreachable
            return None


def describe_stall(lost: list[int] | None, waited_s: float, what: str) -> str:
    """What a worker that waited ``waited_s`` for ``what`` found: lost ranks, or an unreachable store."""
    waiting = f"while this worker waited {waited_s:.0f} s for the {what}"
    if lost is None:
        return f"the job's key-value store is unreachable (global rank 0's host is likely gone) {waiting}"
    return (
        f"lost rank(s) {lost}: their heartbeats stopped {waiting} (the local BSP module's collectives "
        "wait for them; under NCCL they do not fail before the groups' timeout)"
    )


def describe_loss(error: BaseException, lost: list[int] | None) -> str:
    if lost is None:
        return (
            f"the job's key-value store is unreachable (global rank 0's host is likely gone) after: {error}"
        )
    if lost:
        return f"lost rank(s) {lost}: their heartbeats stopped; the collective failed with: {error}"
    if not _from_communication(error):
        return f"the BSP thread failed while every rank is still alive: {type(error).__name__}: {error}"
    return f"a collective failed while every rank is still alive: {error}"
