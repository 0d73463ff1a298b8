"""Per-step communication statistics of one process: bytes, collectives, time, exposed and hidden time.

:class:`CommStats` wraps the ``torch.distributed`` functions while active (the wrapping of
:mod:`lightning_hier.audit.recorder`, shared through its ``patch_distributed``), and
``torch.distributed.Work.wait``. Only the outermost call counts (``broadcast_object_list`` is one
operation, not the broadcasts it is made of). Every operation becomes a :class:`CommEvent`:

- **kind**: the group's kind, from :meth:`CommStats.register_group` (the strategies' topology:
  ``intra``, ``inter``; the parameter server's groups: ``ps_push`` for its reductions, ``ps_pull``
  for its gathers and broadcasts); point-to-point operations are ``p2p``; an unregistered group that
  spans every rank is ``world``, any other ``other``.
- **bytes**: what this rank contributes or sends (:func:`sent_bytes`); ``wire_bytes`` what a ring
  algorithm makes it put on the link (``2(N-1)/N`` of an all-reduce).
- **active interval**: from the call to completion. A blocking call completes when it returns; an
  asynchronous one (``async_op=True``, ``isend``, ``batch_isend_irecv``) when its future completes
  (host clock) or, for CUDA tensors, when the training thread waits on it (CUDA events on the
  current stream of the tensors' device, the device rule).
- **blocked intervals** of the training thread (the thread that called :meth:`start`): inside a
  blocking call, inside ``Work.wait``, inside a method registered with :meth:`watch`, or a span
  given to :meth:`mark_blocked` (DDP's wait at the end of backward, which happens in C++).

At :meth:`end_step` the operations finished since the last step are accounted: per kind, the time
is the union of the active intervals (the link's busy time), and the **exposed** time is the part of
the training thread's blocked time during which that kind's communication was active (shared equally
among kinds active at once); **hidden** = time - exposed. Operations still running at a step's end
count in the step in which they finish; operations the training thread issues between steps
(validation, checkpoints) go to :attr:`CommStats.outside`.

**Timing every n-th step** (``CommStats(time_every=n)``): on the other steps the wrappers only count each
operation and its bytes (no clock stamps, no completion tracking, ``Work.wait`` passed straight through),
so what the profiler costs there is a few dictionary updates per operation; those steps'
:class:`StepStats` have ``timed=False`` and zero times. A latency-bound pipeline, whose every message
passes the wrappers, is where that matters.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from bisect import bisect_right
from dataclasses import dataclass, field
from functools import partial
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist

from lightning_hier.audit.recorder import (
    OBJECT_OPS,
    POINT_TO_POINT,
    group_in,
    p2p_op_name,
    patch_distributed,
    restore_distributed,
    tensors_in,
)

KINDS = ("intra", "inter", "p2p", "ps_push", "ps_pull", "world", "other")
PS = "ps"  # a registered parameter-server group: reductions are pushes, gathers and broadcasts pulls
_PULL_OPS = ("all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_coalesced", "broadcast")
_SENDS = ("send", "isend")
_TENSOR_P2P = ("send", "recv", "isend", "irecv")


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):  # the common case, once per message
        return value.numel() * value.element_size()
    return sum(t.numel() * t.element_size() for t in tensors_in(value))


def sent_bytes(name: str, bound: dict[str, Any], size: int, root: bool) -> tuple[int, int]:
    """``(bytes, wire_bytes)`` this rank sends in operation ``name`` with arguments ``bound`` (by name).

    ``bytes``: the tensors this rank contributes: all-reduce and reduce of ``S`` bytes count ``S``;
    reduce-scatter counts its whole input; all-gather and gather the local input; all-to-all the
    input; broadcast and scatter count on the source rank only; send counts the tensor, receive 0.
    Object collectives and barriers count 0 (control traffic of unknown pickled size).
    ``wire_bytes``: what a ring puts on this rank's outgoing link for a group of ``size``:
    all-reduce ``2(N-1)/N S``, reduce-scatter and all-to-all ``(N-1)/N S``, all-gather ``(N-1) S``;
    the others as ``bytes``.
    """
    if name in OBJECT_OPS or name in ("barrier", "monitored_barrier", "send_object_list", "recv_object_list"):
        return 0, 0
    if name in ("recv", "irecv"):
        return 0, 0
    if name in ("all_reduce", "reduce"):
        n = _nbytes(bound.get("tensor"))
        return n, (2 * (size - 1) * n // size if name == "all_reduce" else n)
    if name == "all_reduce_coalesced":
        n = _nbytes(bound.get("tensors"))
        return n, 2 * (size - 1) * n // size
    if name == "reduce_scatter":
        n = _nbytes(bound.get("input_list"))
        return n, (size - 1) * n // size
    if name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        n = _nbytes(bound.get("input"))
        return n, (size - 1) * n // size
    if name == "all_gather":
        n = _nbytes(bound.get("tensor"))
        return n, (size - 1) * n
    if name in ("all_gather_into_tensor", "all_gather_single"):
        n = _nbytes(bound.get("input_tensor"))
        return n, (size - 1) * n
    if name == "all_gather_coalesced":
        n = _nbytes(bound.get("input_tensor_list"))
        return n, (size - 1) * n
    if name == "gather":
        n = _nbytes(bound.get("tensor"))
        return n, n
    if name in ("broadcast", "scatter"):
        n = _nbytes(bound.get("tensor" if name == "broadcast" else "scatter_list")) if root else 0
        return n, n
    if name in ("all_to_all", "all_to_all_single"):
        n = _nbytes(bound.get("input_tensor_list" if name == "all_to_all" else "input"))
        return n, (size - 1) * n // size
    if name in _SENDS:
        n = _nbytes(bound.get("tensor"))
        return n, n
    return 0, 0


# ---------------------------------------------------------------------- clocks
class _Clock:
    """Host clock for host tensors; CUDA events for CUDA tensors, recorded on the tensors' device.

    A stamp is a float (``perf_counter()``) or a recorded ``torch.cuda.Event``; :meth:`seconds` places
    either on one timeline (seconds since :meth:`reset`). CUDA times two events only if both were
    recorded on one device, and the thread that stamps need not have the tensors' device current (a
    communication thread that never called ``torch.cuda.set_device`` has GPU 0 current on every rank):
    so each event is recorded on the current stream of the operation's device, each device has an origin
    event of its own, and each origin keeps the host moment it was recorded at.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self._origin_host = perf_counter()
        # device index -> (origin event, its host moment in seconds since _origin_host)
        self._origins: dict[int, tuple[Any, float]] = {}
        self._events = torch.cuda.is_available() and torch.cuda.is_initialized()
        if self._events:  # the training thread's device now; any other at its first stamp
            self._origin(torch.cuda.current_device())

    def _origin(self, device: int) -> tuple[Any, float]:
        with self._lock:  # communication threads may stamp a device's first event at once
            origin = self._origins.get(device)
            if origin is None:
                origin = self._origins[device] = (_event_on(device), perf_counter() - self._origin_host)
        return origin

    @staticmethod
    def host() -> float:
        return perf_counter()

    def stamp(self, device: int | None) -> Any:
        """Now: a CUDA event on ``device`` (the index of the operation's tensors' device), or the host
        clock for ``None`` (host tensors) and where CUDA was not in use at :meth:`reset`."""
        if device is None or not self._events:
            return perf_counter()
        if device not in self._origins:
            self._origin(device)
        return _event_on(device)

    def seconds(self, stamp: Any) -> float:
        if isinstance(stamp, float):
            return stamp - self._origin_host
        stamp.synchronize()
        origin, at = self._origins[stamp.device.index]
        return at + origin.elapsed_time(stamp) / 1000.0

    @staticmethod
    def ready(stamp: Any) -> bool:
        """Whether :meth:`seconds` can read ``stamp`` without waiting for the device."""
        return isinstance(stamp, float) or stamp.query()


def _event_on(device: int) -> Any:
    """A timing event recorded on this thread's current stream of ``device``, whatever device the thread
    has current (the event takes the stream's device)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


# ---------------------------------------------------------------------- records
@dataclass(slots=True)
class CommEvent:
    """One operation as this rank issued it (stamps: see :class:`_Clock`)."""

    op: str
    kind: str
    nbytes: int
    wire_bytes: int
    training_thread: bool
    cuda: bool
    issued: Any
    done: Any = None  # completion stamp; None while in flight
    device: int | None = None  # the CUDA device of the tensors, which the stamps are recorded on


@dataclass
class KindStats:
    """One step's communication over one kind of group, on one rank."""

    count: int = 0
    nbytes: int = 0
    wire_bytes: int = 0
    time_s: float = 0.0  # union of the operations' active intervals
    exposed_s: float = 0.0  # the part of it the training thread was blocked on

    @property
    def hidden_s(self) -> float:
        return max(0.0, self.time_s - self.exposed_s)

    def add(self, other: KindStats) -> None:
        self.count += other.count
        self.nbytes += other.nbytes
        self.wire_bytes += other.wire_bytes
        self.time_s += other.time_s
        self.exposed_s += other.exposed_s


@dataclass
class StepStats:
    """One training step of one rank (``timed=False``: counts and bytes only, see ``time_every``)."""

    index: int
    step_s: float  # wall time from begin_step to end_step
    exposed_s: float  # blocked time with any communication active
    kinds: dict[str, KindStats] = field(default_factory=dict)
    timed: bool = True

    @property
    def compute_s(self) -> float:
        return max(0.0, self.step_s - self.exposed_s)


# ---------------------------------------------------------------------- the profiler
class _Depth(threading.local):
    """Per thread: whether a wrapped call is in progress (a class default, so reading it needs no
    ``getattr(..., 0)``; read on every wrapped call and every ``Work.wait``)."""

    depth = 0


class CommStats:
    """Measures this process's ``torch.distributed`` traffic while active (``with CommStats() as s``)."""

    def __init__(self, time_every: int = 1) -> None:
        """``time_every``: time the operations of every n-th step (steps ``0, n, 2n, ...``); the others
        count operations and bytes only."""
        if isinstance(time_every, bool) or not isinstance(time_every, int) or time_every < 1:
            raise ValueError(f"time_every must be an integer >= 1, got {time_every!r}.")
        self.time_every = time_every
        self._timing = True  # the open step is timed (between steps: whether the last one was)
        self._counts: dict[str, KindStats] = {}  # an untimed step's operations so far
        self.clock = _Clock()
        self.steps: list[StepStats] = []
        self.outside: dict[str, KindStats] = {}  # issued by the training thread between steps
        self._kinds: dict[int, tuple[Any, str]] = {}  # id(group) -> (group, registered kind)
        self._groups: dict[int, tuple[Any, str, int, int]] = {}  # id(group) -> (group, kind, size, rank)
        self._events: list[CommEvent] = []
        self._blocked: list[tuple[Any, Any]] = []
        self._pending: dict[int, tuple[dist.Work, list[CommEvent]]] = {}
        self._lock = threading.Lock()
        self._local = _Depth()
        self._active = False
        self._originals: dict[tuple[Any, str], Any] = {}
        self._watched: list[tuple[Any, str, Any]] = []
        self._work_wait: Any = None  # torch's Work.wait, while wrapped
        self._timed_wait: Any = None  # our wrapper of it
        self._default_group: Any = None
        self._thread = threading.get_ident()
        self._window: int | None = None
        self._window_start: float = 0.0
        # closed steps whose CUDA stamps the device has not reached yet: accounted once it has, so the
        # profiler never makes the host wait for the device (which would cost the overlap it measures)
        # (index, events, blocked, start, end, operations counted without timing, timed)
        self._deferred: list[
            tuple[int, list[CommEvent], list[tuple[Any, Any]], float, float, dict[str, KindStats], bool]
        ] = []
        self._rank = 0
        self._world = 1
        self._params: dict[str, list[str]] = {}
        self._p2p_names: dict[Any, str] = {}  # a P2POp's function -> "isend" / "irecv"
        # operations found finished at a step's end whose moment of completion nobody saw (counted as
        # ending there, or on CUDA at their issue); a diagnostic of the timing, not of the bytes
        self.unobserved_completions = 0

    # ------------------------------------------------------------------ setup
    def register_group(self, group: dist.ProcessGroup | None, kind: str) -> None:
        """Name the kind of ``group`` (``"intra"``, ``"inter"``, ``"world"``, ``"ps"`` for a parameter
        server's group, or any label); unregistered groups are ``world`` or ``other``."""
        if group is not None:
            self._kinds[id(group)] = (group, kind)
            self._groups.pop(id(group), None)

    def watch(self, obj: Any, name: str) -> None:
        """Count time the training thread spends in ``obj.name(...)`` as blocked on communication (a
        method that waits for another thread's collectives); undone by :meth:`stop`."""
        original = getattr(obj, name)
        had_own = name in getattr(obj, "__dict__", {})

        def waiting(*args: Any, **kwargs: Any) -> Any:
            if not self._active or not self._timing or threading.get_ident() != self._thread:
                return original(*args, **kwargs)
            start = self.clock.host()
            try:
                return original(*args, **kwargs)
            finally:
                self._add_blocked(start, self.clock.host(), training=True)

        setattr(obj, name, waiting)
        self._watched.append((obj, name, original if had_own else None))

    def mark_blocked(self, start: float, end: float) -> None:
        """Count host-clock span ``[start, end]`` as the training thread blocked on communication."""
        if end > start:
            self._add_blocked(start, end)

    # ------------------------------------------------------------------ start / stop
    def __enter__(self) -> CommStats:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def active(self) -> bool:
        return self._active

    def start(self) -> None:
        """Wrap the ``torch.distributed`` functions and ``Work.wait``; the caller is the training thread."""
        if self._active:
            return
        self._thread = threading.get_ident()
        if dist.is_available() and dist.is_initialized():
            self._rank, self._world = dist.get_rank(), dist.get_world_size()
        self.clock.reset()
        self._default_group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        self._active = True
        self._originals = patch_distributed(self._wrap)
        self._work_wait = dist.Work.wait
        self._timed_wait = self._wrap_wait(self._work_wait)
        dist.Work.wait = self._timed_wait  # type: ignore[method-assign]

    def stop(self) -> None:
        """Undo every wrapping (idempotent); closed steps are accounted (waiting for the device where
        needed), what is still in flight is accounted as outside steps."""
        self._account_ready(wait=True)
        if not self._active and not self._originals and self._work_wait is None:
            return
        self._active = False
        restore_distributed(self._originals)
        if self._work_wait is not None:
            if dist.Work.wait is self._timed_wait:  # a wrapper installed on top of ours stays
                dist.Work.wait = self._work_wait  # type: ignore[method-assign]
            self._work_wait = self._timed_wait = None
        for obj, name, original in reversed(self._watched):
            if original is None:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)
            else:
                setattr(obj, name, original)
        self._watched.clear()
        with self._lock:
            leftover, self._events, self._blocked = self._events, [], []
            counted, self._counts = self._counts, {}
            self._pending.clear()
            self._window = None
        for event in leftover:
            self._tally_outside(event)
        for kind, stats in counted.items():
            self.outside.setdefault(kind, KindStats()).add(stats)

    # ------------------------------------------------------------------ steps
    def begin_step(self, index: int) -> None:
        """A training step starts on the training thread."""
        with self._lock:
            self._window = index
            self._window_start = self.clock.host()
            self._blocked = []
            self._timing = index % self.time_every == 0
            self._wait_only_when_needed()

    def _wait_only_when_needed(self) -> None:
        """``Work.wait`` wrapped for a timed step, or while a timed step's operation is still pending (its
        wait stamps its end); torch's own otherwise: an untimed step has nothing to stamp, and the
        pipeline waits dozens of times per step on its critical path."""
        if self._work_wait is None:
            return
        wanted = self._timed_wait if self._timing or self._pending else self._work_wait
        if dist.Work.wait in (self._timed_wait, self._work_wait):  # not when another wrapper sits on top
            dist.Work.wait = wanted  # type: ignore[method-assign]

    def end_step(self) -> list[StepStats]:
        """Close the step that :meth:`begin_step` opened; returns the steps accounted now, in order.

        A step timed with CUDA events is accounted once the device has passed all of them (at a later
        step's end, or at :meth:`stop`), so the list may be empty, or hold earlier steps too.
        """
        end = self.clock.host()
        with self._lock:
            if self._window is None:
                return []
            index, start = self._window, self._window_start
            self._window = None
            for work, events in list(self._pending.values()):
                for event in events:
                    if event.done is None and _completed(work):
                        event.done = event.issued if event.cuda else end  # finished, moment unknown
                        self.unobserved_completions += 1
            finished = [e for e in self._events if e.done is not None]
            self._events = [e for e in self._events if e.done is None]
            self._pending = {k: v for k, v in self._pending.items() if any(e.done is None for e in v[1])}
            blocked, self._blocked = self._blocked, []
            counts, self._counts = self._counts, {}
        if not self._timing:  # operations of earlier timed steps that finished here count here
            for event in finished:
                _tally(counts, event)
            finished, blocked = [], []
        self._deferred.append((index, finished, blocked, start, end, counts, self._timing))
        return self._account_ready(wait=False)

    def _account_ready(self, wait: bool) -> list[StepStats]:
        """Account deferred steps in order while the device has reached their stamps (all if ``wait``)."""
        accounted = []
        ready = self.clock.ready
        while self._deferred:
            index, events, blocked, start, end, counts, timed = self._deferred[0]
            if not timed:  # nothing to read from the device
                self._deferred.pop(0)
                stats = StepStats(index, end - start, 0.0, counts, timed=False)
                self.steps.append(stats)
                accounted.append(stats)
                continue
            on_device = _on_device(events, blocked)
            if not wait and on_device:  # host stamps (floats) are always readable
                stamps = [e.issued for e in events] + [e.done for e in events]
                stamps += [s for pair in blocked for s in pair]
                if not all(ready(stamp) for stamp in stamps):
                    break
            self._deferred.pop(0)
            stats = self._account(index, events, blocked, start, end, on_device)
            for kind, counted in counts.items():  # another thread's, counted in an untimed step
                stats.kinds.setdefault(kind, KindStats()).add(counted)
            self.steps.append(stats)
            accounted.append(stats)
        return accounted

    def _account(
        self,
        index: int,
        events: list[CommEvent],
        blocked: list[tuple[Any, Any]],
        start: float,
        end: float,
        on_device: bool | None = None,
    ) -> StepStats:
        """One step's totals per kind, and the union of active (and of exposed) time (run every step on
        every rank, so kept lean). Where the kinds never run at the same moment (a pipeline's p2p, then
        its loss broadcast) each kind's time is the union of its operations and its exposed time the
        part of that union the training thread was blocked in; otherwise a sweep over the start and end
        marks shares a blocked moment equally among the kinds running then (a kind is a small integer in
        the marks, the running kinds a counter)."""
        # host stamps are perf_counter floats: only differences are taken, so they are used as they are;
        # CUDA events (``on_device``: see _on_device) are read through the clock
        if on_device is None:
            on_device = _on_device(events, blocked)
        seconds = self.clock.seconds if on_device else float
        t0, t1 = seconds(start), seconds(end)
        kinds: dict[str, KindStats] = {}
        intervals: dict[str, list[tuple[float, float]]] = {}
        for event in events:
            kind = event.kind
            stats = kinds.get(kind)
            if stats is None:
                stats = kinds[kind] = KindStats()
                intervals[kind] = []
            stats.count += 1
            stats.nbytes += event.nbytes
            stats.wire_bytes += event.wire_bytes
            a, b = seconds(event.issued), seconds(event.done)
            if b > a:
                intervals[kind].append((a, b))
        spans = []
        for a_stamp, b_stamp in blocked:
            a, b = seconds(a_stamp), seconds(b_stamp)
            a = t0 if a < t0 else a
            b = t1 if b > t1 else b
            if b > a:
                spans.append((a, b))
        busy = [_union_spans(intervals[kind]) for kind in kinds]
        if not any(_overlap(left, right) > 0.0 for i, left in enumerate(busy) for right in busy[i + 1 :]):
            blocked_union = _union_spans(spans)
            exposed_total = 0.0
            for stats, union in zip(kinds.values(), busy):
                stats.time_s += sum(b - a for a, b in union)
                stats.exposed_s += _overlap(union, blocked_union)
                exposed_total += stats.exposed_s
            return StepStats(index, t1 - t0, exposed_total, kinds)
        marks: list[tuple[float, int, int]] = []  # (time, +1 / -1, kind's slot; -1: blocked)
        for i, kind in enumerate(kinds):
            for a, b in intervals[kind]:
                marks.append((a, 1, i))
                marks.append((b, -1, i))
        for a, b in spans:
            marks.append((a, 1, -1))
            marks.append((b, -1, -1))
        marks.sort()  # by time, ends before starts at one moment
        active = [0] * len(kinds)
        time_s = [0.0] * len(kinds)
        exposed_s = [0.0] * len(kinds)
        running = 0  # kinds with an operation in flight
        blocked_depth = 0
        exposed_total = 0.0
        previous = marks[0][0] if marks else 0.0
        for moment, delta, i in marks:
            span = moment - previous
            if span > 0 and running:
                share = span / running if blocked_depth > 0 else 0.0
                if share:
                    exposed_total += span
                for k, n in enumerate(active):
                    if n > 0:
                        time_s[k] += span
                        exposed_s[k] += share
            previous = moment
            if i < 0:
                blocked_depth += delta
            else:
                before = active[i]
                active[i] = before + delta
                if before == 0:
                    running += 1
                elif before + delta == 0:
                    running -= 1
        for k, stats in enumerate(kinds.values()):
            stats.time_s += time_s[k]
            stats.exposed_s += exposed_s[k]
        return StepStats(index, t1 - t0, exposed_total, kinds)

    def _tally_outside(self, event: CommEvent) -> None:
        _tally(self.outside, event)

    def _count(self, kind: str, nbytes: int, wire: int, training: bool, count: int = 1) -> None:
        """An untimed step's operation: its count and bytes only. The training thread's between steps go to
        :attr:`outside`; another thread's to the step that ends next, as its timed operations do."""
        with self._lock:  # another thread may count at the same moment (the += is not atomic)
            totals = self.outside if training and self._window is None else self._counts
            _add(totals, kind, nbytes, wire, count)

    # ------------------------------------------------------------------ wrapping
    def _group_info(self, group: Any) -> tuple[Any, str, int, int]:
        info = self._groups.get(id(group))
        if info is None:
            registered = self._kinds.get(id(group))
            size = group.size()
            if registered is not None:
                kind = registered[1]
            elif group is dist.group.WORLD or size == self._world:
                kind = "world"
            else:
                kind = "other"
            info = (group, kind, size, group.rank())
            self._groups[id(group)] = info
        return info

    def _bind(
        self, name: str, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        params = self._params.get(name)
        if params is None:
            params = self._params[name] = list(inspect.signature(original).parameters)
        bound = dict(zip(params, args))
        bound.update(kwargs)
        return bound

    def _wrap(self, name: str, original: Any) -> Any:
        local = self._local
        batch = name == "batch_isend_irecv"
        record = self._batch if batch else partial(self._call, name)
        if batch:
            count = self._count_batch
        elif name in _TENSOR_P2P:  # a pipeline's headers, once per micro-batch: no binding needed
            count = partial(self._count_tensor_p2p, name in _SENDS)
        else:
            count = partial(self._count_call, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not self._active or local.depth:
                return original(*args, **kwargs)
            local.depth = 1
            try:
                return (record if self._timing else count)(original, args, kwargs)
            finally:
                local.depth = 0

        return wrapped

    def _describe(
        self, name: str, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[str, int, int, int | None]:
        """``(kind, bytes, wire bytes, CUDA device index or None)`` of a call of ``name``."""
        if name in _TENSOR_P2P:  # a pipeline's headers, once per micro-batch: no binding needed
            tensor = args[0] if args else kwargs["tensor"]
            nbytes = _nbytes(tensor) if name in _SENDS else 0
            return "p2p", nbytes, nbytes, _cuda_index(tensor)
        bound = self._bind(name, original, args, kwargs)
        group = group_in(args, kwargs) or self._default_group or dist.group.WORLD
        _, registered, size, rank = self._group_info(group)
        root = False
        if name in ("broadcast", "scatter"):
            src, group_src = bound.get("src"), bound.get("group_src")
            root = (src == self._rank) if src is not None else (group_src == rank)
        nbytes, wire = sent_bytes(name, bound, size, root)
        return _kind_of(name, registered), nbytes, wire, _cuda_device(bound)

    def _count_call(self, name: str, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        kind, nbytes, wire, _ = self._describe(name, original, args, kwargs)
        self._count(kind, nbytes, wire, threading.get_ident() == self._thread)
        return original(*args, **kwargs)

    def _count_tensor_p2p(
        self, sends: bool, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        nbytes = (args[0] if args else kwargs["tensor"]).nbytes if sends else 0
        self._count("p2p", nbytes, nbytes, threading.get_ident() == self._thread)
        return original(*args, **kwargs)

    def _count_batch(self, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        ops = args[0] if args else kwargs["p2p_op_list"]
        sent = 0
        for op in ops:  # one count for the batch: the pipeline's critical path runs through here
            if self._p2p_name(op) == "isend":
                sent += op.tensor.nbytes
        self._count("p2p", sent, sent, threading.get_ident() == self._thread, len(ops))
        return original(*args, **kwargs)

    def _call(self, name: str, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        kind, nbytes, wire, device = self._describe(name, original, args, kwargs)
        event = self._issue(name, kind, nbytes, wire, device)
        try:
            result = original(*args, **kwargs)
        except BaseException:
            event.done = self.clock.stamp(device)
            raise
        returned = self.clock.stamp(device)
        training = event.training_thread
        if result is not None and hasattr(result, "is_completed"):  # a Work (isinstance costs ~1 us here)
            self._track(result, [event], training)
        else:
            event.done = returned
        if training:
            self._add_blocked(event.issued, returned, training)
        return result

    def _p2p_name(self, op: Any) -> str:
        """``"isend"`` / ``"irecv"`` of a ``P2POp``, looked up once per function."""
        name = self._p2p_names.get(op.op)
        if name is None:
            name = self._p2p_names[op.op] = p2p_op_name(op)
        return name

    def _batch(self, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        ops = args[0] if args else kwargs["p2p_op_list"]
        training = threading.get_ident() == self._thread
        if ops and ops[0].tensor.is_cuda:
            return self._batch_on_device(original, args, kwargs, ops, training, _cuda_index(ops[0].tensor))
        # host tensors, a pipeline's every message: kept lean (one stamp for the ops issued together,
        # each op's name looked up once per function), since this runs on the pipeline's critical path
        issued = perf_counter()
        events = []
        for op in ops:
            name = self._p2p_name(op)
            nbytes = op.tensor.nbytes if name == "isend" else 0
            events.append(CommEvent(name, "p2p", nbytes, nbytes, training, False, issued))
        self._file(events, training)
        works = original(*args, **kwargs)
        self._track_batch(works, events, training, perf_counter())
        return works

    def _batch_on_device(
        self,
        original: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        ops: list[Any],
        training: bool,
        device: int | None,
    ) -> Any:
        events = []
        for op in ops:
            name = self._p2p_name(op)
            nbytes = _nbytes(op.tensor) if name == "isend" else 0
            events.append(self._issue(name, "p2p", nbytes, nbytes, device, training))
        works = original(*args, **kwargs)
        self._track_batch(works, events, training, self.clock.stamp(device))
        return works

    def _track_batch(self, works: Any, events: list[CommEvent], training: bool, returned: Any) -> None:
        """After ``batch_isend_irecv`` returned at ``returned``: each op's Work tracked (one Work for all
        when coalesced, none: complete now), and the call counted as the training thread blocked."""
        works_list = list(works or [])
        if len(works_list) == len(events):
            for work, event in zip(works_list, events):
                self._track(work, [event], training)
        elif works_list:  # coalesced: one handle for all of them
            self._track(works_list[-1], events, training)
        else:
            for event in events:
                event.done = returned
        if events and training:
            self._add_blocked(events[0].issued, returned, training)

    def _file(self, events: list[CommEvent], training: bool) -> None:
        """Add operations just issued to the open step (or, from the training thread between steps,
        to :attr:`outside`)."""
        if not training:
            with self._lock:
                self._events.extend(events)
        elif self._window is None:
            for event in events:
                self._tally_outside(event)
                event.done = event.issued  # not tracked further
        else:
            self._events.extend(events)

    def _issue(
        self, name: str, kind: str, nbytes: int, wire: int, device: int | None, training: bool | None = None
    ) -> CommEvent:
        """An operation on CUDA device ``device`` (``None``: host tensors) issued now."""
        if training is None:
            training = threading.get_ident() == self._thread
        stamp = self.clock.stamp(device)
        event = CommEvent(name, kind, nbytes, wire, training, device is not None, stamp, device=device)
        # no lock on the training thread: the lists are swapped only by that thread (begin_step /
        # end_step / stop), and another thread's append under the lock cannot interleave with it
        self._file([event], training)
        return event

    def _track(self, work: dist.Work, events: list[CommEvent], training: bool = False) -> None:
        """Completion of an asynchronous operation: its future (host clock) or a wait (CUDA)."""
        key = id(work)
        if training:  # the training thread swaps the dict itself (see _issue)
            self._pending[key] = (work, events)
        else:
            with self._lock:
                self._pending[key] = (work, events)
        if not events[0].cuda:
            # a host operation's end is stamped at its Work.wait (every issuer here waits, in the step
            # or at its end), else at the step's end. A future callback would be exact without a waiter,
            # but get_future alone cost 40-75 us per operation on gloo, which the pipeline's many small
            # messages pay on its critical path (1.25x step time). Wrapping Work.is_completed as well
            # cost ddp 4-5 % although nothing called it (benchmarks/README.md)
            return
        try:
            future = work.get_future()
        except Exception:  # noqa: BLE001 - some works have no future; a wait or end_step completes them
            return

        def completed(_: Any) -> None:
            # on CUDA the callback runs at once (NCCL's future completes when the collective is queued)
            # with current streams made to wait for the collective: an event recorded here fires when
            # the device has finished it, whether or not anyone waits on the work (DDP's comm hook never does)
            now = self.clock.stamp(events[0].device)
            for event in events:
                if event.done is None:
                    event.done = now

        future.add_done_callback(completed)

    def _wrap_wait(self, original: Any) -> Any:
        local = self._local

        def wait(work: dist.Work, *args: Any, **kwargs: Any) -> Any:
            if not self._active or local.depth:  # inside a wrapped blocking call
                return original(work, *args, **kwargs)
            entry = self._pending.get(id(work))
            events = entry[1] if entry is not None and entry[0] is work else ()
            if not events and not self._timing:  # an untimed step's operation: nothing to stamp
                return original(work, *args, **kwargs)
            device = events[0].device if events else None
            before = self.clock.stamp(device)
            try:
                return original(work, *args, **kwargs)
            finally:
                after = self.clock.stamp(device)
                for event in events:
                    if event.done is None:
                        event.done = after
                if threading.get_ident() == self._thread:
                    if events:  # its events are complete: end_step need not look at it again
                        self._pending.pop(id(work), None)
                    self._add_blocked(before, after, training=True)

        wait.__wrapped__ = original  # type: ignore[attr-defined]
        return wait

    def _add_blocked(self, start: Any, end: Any, training: bool = False) -> None:
        if training:  # the training thread swaps the list itself (see _issue)
            if self._window is not None:
                self._blocked.append((start, end))
            return
        with self._lock:
            if self._window is not None:
                self._blocked.append((start, end))


def _add(totals: dict[str, KindStats], kind: str, nbytes: int, wire: int, count: int = 1) -> None:
    stats = totals.get(kind)
    if stats is None:
        stats = totals[kind] = KindStats()
    stats.count += count
    stats.nbytes += nbytes
    stats.wire_bytes += wire


def _tally(totals: dict[str, KindStats], event: CommEvent) -> None:
    _add(totals, event.kind, event.nbytes, event.wire_bytes)


def _union_spans(spans: list[tuple[float, float]]) -> list[list[float]]:
    """The union of ``(a, b)`` spans (``a < b``) as sorted disjoint ``[a, b]`` pairs."""
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            if b > merged[-1][1]:
                merged[-1][1] = b
        else:
            merged.append([a, b])
    return merged


def _overlap(left: list[list[float]], right: list[list[float]]) -> float:
    """Total length of the intersection of two sorted lists of disjoint intervals (each interval of the
    shorter list finds its first candidate in the longer one by bisection: a step's one broadcast
    against its dozens of blocked spans costs a few comparisons)."""
    if len(left) > len(right):
        left, right = right, left
    ends = [b for _, b in right]
    total = 0.0
    for a, b in left:
        k = bisect_right(ends, a)
        while k < len(right) and right[k][0] < b:
            lo = a if a > right[k][0] else right[k][0]
            hi = b if b < right[k][1] else right[k][1]
            if hi > lo:
                total += hi - lo
            k += 1
    return total


def _kind_of(name: str, registered: str) -> str:
    if name in POINT_TO_POINT:
        return "p2p"
    if registered == PS:
        return "ps_pull" if name in _PULL_OPS else "ps_push"
    return registered


def _on_device(events: list[CommEvent], blocked: list[tuple[Any, Any]]) -> bool:
    """Whether a step holds device stamps (CUDA events) rather than host floats only."""
    return any(event.cuda for event in events) or any(type(a) is not float for a, _ in blocked)


def _cuda_index(tensor: torch.Tensor) -> int | None:
    """The index of ``tensor``'s CUDA device, ``None`` off CUDA."""
    return tensor.get_device() if tensor.is_cuda else None


def _cuda_device(bound: dict[str, Any]) -> int | None:
    """The CUDA device index of an operation's first tensor argument (``None``: a host operation)."""
    for value in bound.values():
        if isinstance(value, torch.Tensor):
            return _cuda_index(value)
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return _cuda_index(value[0])
    return None


def _completed(work: dist.Work) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - a work that cannot say: treat as finished
        return True
