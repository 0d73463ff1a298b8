"""When things happened during one backward: host clock on CPU, CUDA events on GPU.

On a GPU the host runs ahead of the device: a gradient hook runs when its kernel is *queued*,
not when the gradient exists. :class:`StepClock` records a CUDA event on the current stream at
each mark instead and turns the events into seconds once per step. Resolving a step's events
waits for that step's work, so on CUDA a step is resolved at the *next* step's resolve, when its
events have long completed: no extra host-device synchronisation, and time bucketing sees each
step's timeline one step late. On CPU marks are ``perf_counter()`` and resolve at once.

Because of that lag a step's marks come back with the *tag* it was finished with
(:attr:`StepClock.resolved_tag`): the caller names each step (its index, the bucket layout it ran
with) so that a timeline is never taken for the step in which it happens to resolve.
:meth:`StepClock.mark_event` takes an event recorded elsewhere, e.g. on the communication stream
after a bucket's last collective, which is when that bucket is really done.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from time import perf_counter
from typing import Any

import torch

EventFactory = Callable[[], Any]


def _cuda_event() -> Any:
    return torch.cuda.Event(enable_timing=True)


class StepClock:
    """Marks taken during one step; :meth:`resolve` returns ``{key: seconds after start}``.

    ``event_factory`` makes objects with ``record()``, ``elapsed_time(other)`` (milliseconds) and
    ``query()``; it defaults to CUDA events on a CUDA device. Tests pass a fake.
    """

    def __init__(self, device: torch.device, event_factory: EventFactory | None = None) -> None:
        if event_factory is None and device.type == "cuda":
            event_factory = _cuda_event
        self.event_factory = event_factory
        self._start: Any = None
        self._marks: dict[Hashable, Any] = {}
        # events of a finished step, and the tag it was finished with
        self._pending: tuple[Any, dict[Hashable, Any], Hashable] | None = None
        self.resolved_tag: Hashable = None  # the tag of the step the last finish() returned

    @property
    def uses_events(self) -> bool:
        return self.event_factory is not None

    @property
    def started(self) -> bool:
        return self._start is not None

    def _now(self) -> Any:
        if self.event_factory is None:
            return perf_counter()
        event = self.event_factory()
        event.record()
        return event

    def start(self) -> None:
        """Begin a step (the clock's zero); a second call in the same step is ignored."""
        if self._start is None:
            self._start = self._now()

    def mark(self, key: Hashable) -> None:
        """Record ``key`` now (on the current stream on CUDA); the last mark of a key wins."""
        if self._start is None:
            self.start()
        self._marks[key] = self._now()

    def mark_event(self, key: Hashable, event: Any) -> None:
        """Record ``key`` at an event already recorded (on another stream); ``None``: now, as :meth:`mark`."""
        if event is None or self.event_factory is None:
            self.mark(key)
            return
        if self._start is None:
            self.start()
        self._marks[key] = event

    def host_seconds(self) -> float:
        """Seconds on the host clock since the step started (CPU only)."""
        assert self.event_factory is None and self._start is not None
        return perf_counter() - self._start

    def finish(self, tag: Hashable = None) -> dict[Hashable, float] | None:
        """End the step (named ``tag``) and return the newest resolvable step's ``{key: seconds}``;
        :attr:`resolved_tag` is then that step's tag.

        On CPU that is this step. With events it is the previous step (``None`` on the first),
        and this step's events wait for the next call.
        """
        start, marks = self._start, self._marks
        self._start, self._marks = None, {}
        if start is None:
            return None
        if self.event_factory is None:
            self.resolved_tag = tag
            return {key: value - start for key, value in marks.items()}
        previous, self._pending = self._pending, (start, marks, tag)
        if previous is None:
            return None
        start, marks, self.resolved_tag = previous
        return self._resolve_events(start, marks)

    @staticmethod
    def _resolve_events(start: Any, marks: dict[Hashable, Any]) -> dict[Hashable, float]:
        resolved = {}
        for key, event in marks.items():
            if not event.query():
                event.synchronize()
            resolved[key] = start.elapsed_time(event) / 1e3
        return resolved

    def reset(self) -> None:
        """Forget the current step's marks (an accumulating micro-batch), keep a pending step."""
        self._start, self._marks = None, {}
