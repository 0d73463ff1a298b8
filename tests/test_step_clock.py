"""StepClock: host clock on CPU; on CUDA, events resolved once per step, one step late."""

from __future__ import annotations

import time

import torch

from lightning_hier.bucketing.step_clock import StepClock


class FakeEvent:
    """A CUDA event stand-in: ``record()`` stamps a device time from a shared fake device clock."""

    device_ms = 0.0
    records = 0

    def __init__(self) -> None:
        self.at: float | None = None
        self.synchronized = False

    def record(self) -> None:
        FakeEvent.records += 1
        self.at = FakeEvent.device_ms

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.synchronized = True

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None and end.at is not None
        return end.at - self.at


def test_events_are_resolved_one_step_late_in_device_seconds() -> None:
    clock = StepClock(torch.device("cpu"), event_factory=FakeEvent)
    FakeEvent.device_ms = 100.0
    clock.start()
    FakeEvent.device_ms = 112.5  # the gradient exists 12.5 ms into backward on the device
    clock.mark(("ready", 0))
    FakeEvent.device_ms = 130.0
    clock.mark("end")
    assert clock.finish() is None  # nothing resolved yet: step 0's events wait for step 1
    FakeEvent.device_ms = 500.0
    clock.start()
    FakeEvent.device_ms = 503.0
    clock.mark(("ready", 0))
    resolved = clock.finish()
    assert resolved == {("ready", 0): 0.0125, "end": 0.030}  # step 0, in seconds after its start
    FakeEvent.device_ms = 900.0
    clock.start()
    assert clock.finish() == {("ready", 0): 0.003}  # step 1


def test_an_accumulating_micro_batch_is_forgotten_but_a_pending_step_is_kept() -> None:
    clock = StepClock(torch.device("cpu"), event_factory=FakeEvent)
    FakeEvent.device_ms = 0.0
    clock.start()
    FakeEvent.device_ms = 4.0
    clock.mark("a")
    assert clock.finish() is None
    clock.start()
    clock.mark("micro")
    clock.reset()  # no_sync micro-batch
    FakeEvent.device_ms = 10.0
    clock.start()
    assert clock.finish() == {"a": 0.004}


def test_host_clock_resolves_the_same_step() -> None:
    clock = StepClock(torch.device("cpu"))
    assert not clock.uses_events
    clock.start()
    time.sleep(0.01)
    clock.mark("x")
    resolved = clock.finish()
    assert resolved is not None and 0.009 < resolved["x"] < 1.0


def test_a_late_step_comes_back_with_its_own_tag_and_a_foreign_event_counts_as_its_mark() -> None:
    clock = StepClock(torch.device("cpu"), event_factory=FakeEvent)
    FakeEvent.device_ms = 0.0
    clock.start()
    done = FakeEvent()  # recorded on another stream (the communication stream), 7 ms in
    FakeEvent.device_ms = 7.0
    done.record()
    clock.mark_event(("done", 0), done)
    assert clock.finish(tag=(0, "layout a")) is None
    FakeEvent.device_ms = 20.0
    clock.start()
    assert clock.finish(tag=(1, "layout b")) == {("done", 0): 0.007}
    assert clock.resolved_tag == (0, "layout a")  # the step the marks belong to, not the one just ended
