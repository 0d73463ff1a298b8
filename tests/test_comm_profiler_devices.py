"""CommProfiler's CUDA-event timing when the stamping thread has another device current.

A communication thread that never called ``torch.cuda.set_device`` (hier_sliced's reducer thread,
hier_bsp's module thread) has GPU 0 current on every rank. CUDA times two events only if both were
recorded on one device, so the profiler must record each stamp on the device of the operation's
tensors and time it against that device's origin. No GPU here: ``torch.cuda`` is replaced by a stand-in
whose events belong to the device of the stream they were recorded on, and whose ``elapsed_time``
refuses events of two devices as CUDA does; the tensors are host tensors that say they live on a device.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lightning_hier.profiling import CommStats


class _FakeCuda:
    """What the profiler uses of ``torch.cuda``: a current device per thread, streams, timing events."""

    def __init__(self) -> None:
        self.now = 0.0  # the devices' clock, in seconds, moved on by the fake collectives
        self.local = threading.local()
        self.events: list[_FakeEvent] = []
        self.compared: list[tuple[int, int]] = []  # (device of origin, device of stamp) per elapsed_time
        cuda = self

        class Event(_FakeEvent):
            def __init__(self, enable_timing: bool = False, **_: Any) -> None:
                super().__init__(cuda)

        self.Event = Event

    def current_device(self) -> int:
        return getattr(self.local, "device", 0)  # a thread starts on GPU 0, as under CUDA

    def set_device(self, device: int) -> None:
        self.local.device = device

    def current_stream(self, device: int | None = None) -> _FakeStream:
        return _FakeStream(self.current_device() if device is None else device)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ("current_device", "set_device", "current_stream", "Event"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)


class _FakeStream:
    def __init__(self, index: int) -> None:
        self.device = torch.device("cuda", index)


class _FakeEvent:
    def __init__(self, cuda: _FakeCuda) -> None:
        self.cuda = cuda
        self.device: torch.device | None = None
        self.at = 0.0

    def record(self, stream: _FakeStream | None = None) -> None:
        stream = stream or self.cuda.current_stream()
        self.device, self.at = stream.device, self.cuda.now
        self.cuda.events.append(self)

    def elapsed_time(self, other: _FakeEvent) -> float:
        assert self.device is not None and other.device is not None
        self.cuda.compared.append((self.device.index, other.device.index))
        if self.device != other.device:
            raise RuntimeError("Both events must be recorded on the same device")  # CUDA's refusal
        return (other.at - self.at) * 1e3

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _OnDevice(torch.Tensor):
    """A host tensor that says it lives on CUDA device ``index`` (what the profiler reads of a tensor)."""

    index = 0

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def get_device(self) -> int:  # type: ignore[override]
        return self.index


def _on_device(index: int) -> torch.Tensor:
    tensor = torch.zeros(4).as_subclass(_OnDevice)
    tensor.index = index
    return tensor


class _Group:
    """Stands for a process group of 2 ranks, this one rank 1."""

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 1


class _Work:
    """An asynchronous collective whose future completes once the device has run it (NCCL's callback runs
    in the issuing thread)."""

    def __init__(self, cuda: _FakeCuda) -> None:
        self.cuda = cuda

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> _Work:
        return self

    def add_done_callback(self, callback: Any) -> None:
        self.cuda.now += 0.25
        callback(self)


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> _FakeCuda:
    fake = _FakeCuda()
    fake.install(monkeypatch)

    def all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        if async_op:
            return _Work(fake)
        fake.now += 0.5
        return None

    for module in (c10d, dist):  # what the profiler wraps, in place of torch's collective
        monkeypatch.setattr(module, "all_reduce", all_reduce)
    return fake


def test_a_stamp_from_a_thread_on_gpu_0_is_recorded_on_the_tensors_device(cuda: _FakeCuda) -> None:
    cuda.set_device(1)  # the training thread of rank 1, after Lightning's set_device
    stats = CommStats()
    stats.start()
    try:
        stats.begin_step(0)

        def communication_thread() -> None:  # never calls set_device: GPU 0 is its current device
            assert torch.cuda.current_device() == 0
            dist.all_reduce(_on_device(1), group=_Group())  # blocking: 0.5 s on the device
            dist.all_reduce(_on_device(1), group=_Group(), async_op=True)  # its future: 0.25 s later

        thread = threading.Thread(target=communication_thread)
        thread.start()
        thread.join()
        (step,) = stats.end_step()
    finally:
        stats.stop()
    assert {event.device.index for event in cuda.events} == {1}  # the origin and every stamp
    assert cuda.compared and all(origin == stamp == 1 for origin, stamp in cuda.compared)
    # from the first call's issue to its return, and from the second's issue to its future's callback
    assert step.kinds["other"].count == 2
    assert step.kinds["other"].time_s == pytest.approx(0.5 + 0.25)


def test_each_device_is_timed_against_an_origin_of_its_own(cuda: _FakeCuda) -> None:
    cuda.set_device(1)
    stats = CommStats()
    on_1, on_0 = _Group(), _Group()
    stats.register_group(on_1, "intra")
    stats.register_group(on_0, "inter")
    stats.start()
    try:
        stats.begin_step(0)
        dist.all_reduce(_on_device(1), group=on_1)
        cuda.now = 10.0  # device 0's first stamp long after the start: its origin is made then
        dist.all_reduce(_on_device(0), group=on_0)
        (step,) = stats.end_step()
    finally:
        stats.stop()
    origins = stats.clock._origins
    assert sorted(origins) == [0, 1]  # device 1's at start, device 0's at its first operation
    assert [origins[d][0].device.index for d in (0, 1)] == [0, 1] and origins[0][0].at == 10.0
    assert all(origin == stamp for origin, stamp in cuda.compared)
    assert {stamp for _, stamp in cuda.compared} == {0, 1}
    assert step.kinds["intra"].time_s == pytest.approx(0.5)
    assert step.kinds["inter"].time_s == pytest.approx(0.5)
