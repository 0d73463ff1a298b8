"""Which ranks are gone, asked after a collective failed.

When a worker dies, the others' next collective fails (gloo: the connection closes; otherwise the
group's timeout) with an error that names an address, not a rank. Every rank's :class:`Heartbeat`
bumps a counter in the job's key-value store once a second from a thread of its own (a rank stuck
in a collective still beats); after a failure, the counters that did not move for a few seconds
name the lost ranks. A rank that stops beating because its run ended (it saw the failure too and tore
down) says so in the store first, so a peer still watching does not take it for lost.

Under NCCL a collective whose peer died need not fail at all: the BSP thread waits on the device until
NCCL's watchdog ends the process at the groups' timeout, with a message that names no rank.
:class:`PeerWatch` covers that case from the worker's side: while the worker waits on its local BSP
module, it compares the counters every few seconds and names a rank whose beat stopped, well before
that timeout.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from typing import Any

import torch.distributed as dist

BEAT_SECONDS = 1.0
WATCH_SECONDS = 2.5
# a waiting worker's check for stopped beats: this often, and at most a sixth of the groups' timeout, so
# that two checks (what naming a rank takes) fit well inside it
PEER_CHECK_SECONDS = 10.0
_runs = itertools.count()


def new_run_key() -> str:
    """A prefix the same on every rank (every rank creates its BSP engines in the same order)."""
    return f"lightning_hier/bsp/{next(_runs)}"


class Heartbeat(threading.Thread):
    """Adds one to ``<run_key>/beat/<rank>`` in the default store every ``BEAT_SECONDS`` until stopped."""

    def __init__(self, run_key: str, rank: int) -> None:
        super().__init__(name=f"hier-bsp-heartbeat-rank{rank}", daemon=True)
        self.key = f"{run_key}/beat/{rank}"
        self.left_key = f"{run_key}/left/{rank}"
        # not ``_stop``: that name is threading.Thread's own method, which join() calls (it raised
        # "'Event' object is not callable" there)
        self._stopping = threading.Event()

    def run(self) -> None:
        try:
            store = dist.distributed_c10d._get_default_store()
            while not self._stopping.is_set():
                store.add(self.key, 1)
                self._stopping.wait(BEAT_SECONDS)
        except Exception:  # noqa: BLE001, S110 - the store's host is gone; lost_ranks reports it
            pass

    def stop(self, timeout: float = 5.0) -> None:
        """Stop beating; the thread has ended when this returns (unless a store call hangs past
        ``timeout``), so no beat outlives the run that started it."""
        self._stopping.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout)
        with contextlib.suppress(Exception):  # the store's host is gone: nobody is left to ask
            dist.distributed_c10d._get_default_store().set(self.left_key, "1")


def lost_ranks(run_key: str, world_size: int, watch_s: float = WATCH_SECONDS) -> list[int] | None:
    """Ranks whose heartbeat did not move within ``watch_s`` and that did not leave in order (``None``:
    the store is unreachable, which means the process hosting it, normally global rank 0's, is gone)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        before = _beats(store, run_key, world_size)
        time.sleep(watch_s)
        return _stopped(store, run_key, before, _beats(store, run_key, world_size))
    except Exception:  # noqa: BLE001 - any store failure means its host is unreachable
        return None


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
        try:
            store = dist.distributed_c10d._get_default_store()
            now, beats = time.monotonic(), _beats(store, self.run_key, self.world_size)
            previous, self._sample = self._sample, (now, beats)
            if previous is None or not 0.9 * self.every_s <= now - previous[0] <= 3 * self.every_s:
                return []  # too close to tell a live rank from a lost one, or from an earlier wait
            return _stopped(store, self.run_key, previous[1], beats)
        except Exception:  # noqa: BLE001 - any store failure means its host is unreachable
            return None


def _beats(store: Any, run_key: str, world_size: int) -> list[int]:
    return [store.add(f"{run_key}/beat/{rank}", 0) for rank in range(world_size)]


def _stopped(store: Any, run_key: str, before: list[int], after: list[int]) -> list[int]:
    """The ranks whose counter did not move and that did not leave in order."""
    stopped = [rank for rank, (a, b) in enumerate(zip(before, after)) if a == b]
    return [rank for rank in stopped if not store.check([f"{run_key}/left/{rank}"])]


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


def _from_communication(error: BaseException) -> bool:
    """Whether ``error`` came from torch.distributed (a backend, the network or the store)."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(word in text for word in ("gloo", "nccl", "connection"))
