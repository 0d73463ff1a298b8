"""Which ranks are gone, asked after a collective failed.

When a worker dies, the others' next collective fails (gloo: the connection closes; otherwise the
group's timeout) with an error that names an address, not a rank. Every rank's :class:`Heartbeat`
bumps a counter in the job's key-value store once a second from a thread of its own (a rank stuck
in a collective still beats); after a failure, the counters that did not move for a few seconds
name the lost ranks. A rank that stops beating because its run ended (it saw the failure too and tore
down) says so in the store first, so a peer still watching does not take it for lost.

One thread beats per process: a heartbeat started while another one of this process beats hands its
counter to that thread, and the thread ends with the last counter it beats. Every store call outside
that thread is bounded by :data:`STORE_TIMEOUT_S`: the store's host (global rank 0's process) may be
the rank that is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

BEAT_SECONDS = 1.0
WATCH_SECONDS = 2.5
#: the longest a store call made outside the beating thread may take before the store counts as unreachable
STORE_TIMEOUT_S = 3.0
_T = TypeVar("_T")
_runs = itertools.count()
_lock = threading.Lock()
_beating: Heartbeat | None = None  # the thread that beats for this process, while one does
_exit_registered = False


def new_run_key(kind: str = "live") -> str:
    """A prefix the same on every rank (every rank starts its runs, and heartbeats, in the same order)."""
    return f"lightning_hier/{kind}/{next(_runs)}"


class Heartbeat(threading.Thread):
    """Adds one to ``<run_key>/beat/<rank>`` in the default store every ``BEAT_SECONDS`` until stopped.

    Started while another heartbeat of this process beats, it adds its counter to that one's thread and
    starts none of its own (:attr:`host` is then that heartbeat)."""

    def __init__(self, run_key: str, rank: int, name: str | None = None) -> None:
        super().__init__(name=name or f"hier-heartbeat-rank{rank}", daemon=True)
        self.run_key = run_key
        self.key = f"{run_key}/beat/{rank}"
        self.left_key = f"{run_key}/left/{rank}"
        self.host: Heartbeat | None = None
        self._keys = {self.key}  # the counters this thread beats (its own and those handed to it)
        # not ``_stop``: that name is threading.Thread's own method, which join() calls (it raised
        # "'Event' object is not callable" there)
        self._stopping = threading.Event()
        self._stopped = False

    def start(self) -> None:
        global _beating, _exit_registered
        with _lock:
            if not _exit_registered:
                # registered after the process group's exit handler, so it runs before it (last in, first
                # out), while the store is still there
                atexit.register(_leave_at_exit)
                _exit_registered = True
            host = _beating
            if host is not None and host.is_alive() and not host._stopping.is_set():
                host._keys.add(self.key)
                self.host = host
                return
            _beating = self
        super().start()

    @property
    def beating(self) -> bool:
        """Whether this heartbeat's counter is beaten (by its own thread or the one it was handed to)."""
        return not self._stopped and (self.host is not None or self.is_alive())

    def run(self) -> None:
        try:
            store = dist.distributed_c10d._get_default_store()
            while not self._stopping.is_set():
                for key in sorted(self._keys):
                    store.add(key, 1)
                self._stopping.wait(BEAT_SECONDS)
        except Exception:  # noqa: BLE001, S110 - the store's host is gone; lost_ranks reports it
            pass

    def stop(self, timeout: float = 5.0) -> None:
        """Stop beating this counter and say so in the store; the thread has ended when this returns
        (unless a store call hangs past ``timeout``, or counters handed to it still beat)."""
        global _beating
        if self._stopped:
            return
        self._stopped = True
        host = self.host or self
        with _lock:
            host._keys.discard(self.key)
            ends = not host._keys
            if ends:
                host._stopping.set()
                if _beating is host:
                    _beating = None
        if ends and host.is_alive() and host is not threading.current_thread():
            host.join(timeout)
        with contextlib.suppress(Exception):  # the store's host is gone: nobody is left to ask
            bounded(lambda: dist.distributed_c10d._get_default_store().set(self.left_key, "1"))


def _leave_at_exit() -> None:
    """A process that ends in order leaves in order, even where a teardown raised before its heartbeat's
    stop: its peers must not take it for lost."""
    beating = _beating
    if beating is not None:
        for key in list(beating._keys):
            with contextlib.suppress(Exception):
                left = key.replace("/beat/", "/left/")
                bounded(lambda left=left: dist.distributed_c10d._get_default_store().set(left, "1"))


def bounded(call: Callable[[], _T], timeout_s: float | None = None) -> _T:
    """``call()`` on a daemon thread, waited for at most ``timeout_s`` (default :data:`STORE_TIMEOUT_S`;
    ``TimeoutError`` past it): a store call whose host vanished without closing the connection must not
    hang the caller."""
    timeout_s = STORE_TIMEOUT_S if timeout_s is None else timeout_s
    done = threading.Event()
    result: list[Any] = []

    def run() -> None:
        try:
            result.append((True, call()))
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            result.append((False, error))
        finally:
            done.set()

    threading.Thread(target=run, name="hier-liveness-store", daemon=True).start()
    if not done.wait(timeout_s):
        raise TimeoutError(f"the job's key-value store did not answer within {timeout_s:.0f} s")
    ok, value = result[0]
    if not ok:
        raise value
    return value


def lost_ranks(run_key: str, world_size: int, watch_s: float = WATCH_SECONDS) -> list[int] | None:
    """Ranks whose heartbeat did not move within ``watch_s`` and that did not leave in order (``None``:
    the store is unreachable, which means the process hosting it, normally global rank 0's, is gone).
    Returns within ``watch_s`` plus two :data:`STORE_TIMEOUT_S`."""
    try:
        store = dist.distributed_c10d._get_default_store()
        before = bounded(lambda: beats(store, run_key, world_size))
        time.sleep(watch_s)
        return bounded(lambda: stopped(store, run_key, before, beats(store, run_key, world_size)))
    except Exception:  # noqa: BLE001 - any store failure means its host is unreachable
        return None


def beats(store: Any, run_key: str, world_size: int) -> list[int]:
    """Every rank's counter under ``run_key``."""
    return [store.add(f"{run_key}/beat/{rank}", 0) for rank in range(world_size)]


def stopped(store: Any, run_key: str, before: list[int], after: list[int]) -> list[int]:
    """The ranks whose counter did not move and that did not leave in order."""
    still = [rank for rank, (a, b) in enumerate(zip(before, after)) if a == b]
    return [rank for rank in still if not store.check([f"{run_key}/left/{rank}"])]


def from_communication(error: BaseException) -> bool:
    """Whether ``error`` came from torch.distributed (a backend, the network or the store)."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(word in text for word in ("gloo", "nccl", "connection"))
