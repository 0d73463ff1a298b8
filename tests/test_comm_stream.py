"""The reducers' side-stream protocol, checked on CPU with a stand-in stream that records what happens.

On CUDA a ``work.wait()`` orders the *current* stream after the collective. The reducers must therefore
issue and wait inside the communication stream's context only, so the compute stream (the one the
gradient hooks run on) never waits for a chunk's reduce-scatter during backward, and join the compute
stream to the communication stream once per step, after the last job. A CPU build has no streams, so a
recording stand-in takes :class:`DeviceStream`'s place, and the collectives run on a one-process gloo
group with ``LIGHTNING_HIER_FORCE_COLLECTIVES=1`` (every collective issued, as on a larger group).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import free_port

from lightning_hier.single_rank import FORCE_COLLECTIVES_ENV
from lightning_hier.sliced.comm_stream import HostStream
from lightning_hier.sliced.reducer import InlineReducer, ReduceJob, ThreadedReducer


class RecordingStream(HostStream):
    """Stands in for a CUDA side stream: logs the protocol and knows whether it is the current stream."""

    on_device = True

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self._current = threading.local()
        self._markers = 0

    @property
    def current(self) -> bool:
        return getattr(self._current, "inside", False)

    def ready_marker(self) -> Any:
        self._markers += 1
        marker = ("ready", self._markers)
        self.log.append(("ready", marker, self.current))
        return marker

    def issuing(self, ready: Any):  # noqa: ANN201 - a context manager
        stream = self

        class _Context:
            def __enter__(self) -> None:
                stream.log.append(("enter", ready))
                stream._current.inside = True

            def __exit__(self, *exc: object) -> None:
                stream._current.inside = False
                stream.log.append(("exit",))

        return _Context()

    def keep_alive(self, *tensors: torch.Tensor) -> None:
        self.log.append(("keep_alive", len(tensors), self.current))

    def done_marker(self) -> Any:
        self._markers += 1
        marker = ("done", self._markers)
        self.log.append(("done", marker, self.current))
        return marker

    def join(self, done: Any) -> None:
        self.log.append(("join", done, self.current))

    def enter_thread(self) -> None:
        self.log.append(("enter_thread", threading.current_thread().name))


class _Work:
    """A collective's work handle that notes on which stream its ``wait()`` was called."""

    def __init__(self, work: dist.Work | None, name: str, stream: RecordingStream, waits: list) -> None:
        self._work, self._name, self._stream, self._waits = work, name, stream, waits

    def wait(self) -> bool:
        self._waits.append((self._name, self._stream.current))
        if self._work is not None:
            self._work.wait()
        return True

    def get_future(self) -> Any:
        return self._work.get_future()


@pytest.fixture
def one_process_group(monkeypatch: pytest.MonkeyPatch) -> dist.ProcessGroup:
    monkeypatch.setenv(FORCE_COLLECTIVES_ENV, "1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _record_collectives(monkeypatch: pytest.MonkeyPatch, stream: RecordingStream) -> tuple[list, list]:
    issued: list[tuple[str, bool]] = []
    waits: list[tuple[str, bool]] = []
    for name in ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_reduce"):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def wrapped(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            issued.append((_name, stream.current))
            work = _original(*args, **kwargs)
            return _Work(work, _name, stream, waits) if kwargs.get("async_op") else work

        monkeypatch.setattr(dist, name, wrapped)
    return issued, waits


def _jobs(count: int) -> list[ReduceJob]:
    return [ReduceJob(torch.arange(8.0) + b, [(0, 8)], torch.zeros(8)) for b in range(count)]


def test_inline_reducer_issues_and_waits_on_the_side_stream_and_joins_once(
    one_process_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = RecordingStream()
    issued, waits = _record_collectives(monkeypatch, stream)
    reducer = InlineReducer(one_process_group, one_process_group, chunk_bytes=16, stream=stream)
    jobs = [reducer.submit(job) for job in _jobs(3)]
    # a reduce-scatter and an all-reduce per piece (8 floats in 16-byte chunks: 2 pieces), all issued
    # and all waited for with the side stream current: the compute stream never waits during backward
    assert len(issued) == 3 * 2 * 2 and all(on_side for _, on_side in issued), issued
    assert len(waits) == 3 * 2 * 2 and all(on_side for _, on_side in waits), waits
    assert not any(entry[0] == "join" for entry in stream.log), "the compute stream waited during backward"
    for job in jobs:  # each job waits for its gradients' event, then marks its end on the side stream
        assert ("enter", job.ready_event) in stream.log
        assert job.done_event is not None and ("done", job.done_event, True) in stream.log
    assert all(entry[2] is False for entry in stream.log if entry[0] == "ready"), "ready marked on the side"
    seen: list[int] = []
    reducer.wait_all(jobs, then=lambda index, job: seen.append(index))
    joins = [entry for entry in stream.log if entry[0] == "join"]
    # the compute stream waits once, for the last job
    assert joins == [("join", jobs[-1].done_event, False)]
    assert seen == [0, 1, 2]
    for b, job in enumerate(jobs):  # a sum over one rank: the bucket itself
        torch.testing.assert_close(job.out, torch.arange(8.0) + b)


def test_threaded_reducer_issues_on_the_side_stream_from_its_thread(
    one_process_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    stream = RecordingStream()
    issued, _ = _record_collectives(monkeypatch, stream)
    reducer = ThreadedReducer(one_process_group, one_process_group, chunk_bytes=1 << 20, stream=stream)
    jobs = [reducer.submit(job) for job in _jobs(2)]
    reducer.wait_all(jobs)
    reducer.close()
    assert ("enter_thread", "lightning_hier-comm") in stream.log  # the thread takes the reducer's device
    assert issued and all(on_side for _, on_side in issued), issued
    readies = [entry for entry in stream.log if entry[0] == "ready"]
    assert len(readies) == 2 and all(entry[2] is False for entry in readies)  # on the gradients' stream
    assert [entry for entry in stream.log if entry[0] == "join"] == [("join", jobs[-1].done_event, False)]
    for b, job in enumerate(jobs):
        torch.testing.assert_close(job.out, torch.arange(8.0) + b)


def test_on_the_host_the_reducer_blocks_as_before_and_has_no_stream_events(
    one_process_group: dist.ProcessGroup,
) -> None:
    reducer = InlineReducer(one_process_group, one_process_group)
    job = reducer.submit(_jobs(1)[0])
    assert job.works, "on the host the works stay for wait() to block on"
    assert job.ready_event is None and job.done_event is None
    torch.testing.assert_close(reducer.wait(job), torch.arange(8.0))


def _train_alone(force: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor], list[str]]:
    """Three SGD steps of hier_sliced's engine on one rank; returns the parameters and the collectives."""
    from lightning_hier import HierSlicedEngine, Topology

    monkeypatch.setenv(FORCE_COLLECTIVES_ENV, "1" if force else "0")
    issued: list[str] = []
    names = ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_reduce")
    names += ("all_gather_single",)
    for name in names:
        original = getattr(dist, name, None)
        if original is not None:

            def counting(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
                if not isinstance(kwargs.get("group", args[-1] if args else None), type(None)):
                    issued.append(_name)
                return _original(*args, **kwargs)

            monkeypatch.setattr(dist, name, counting)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = HierSlicedEngine(model, optimizer, Topology(1, 0, 1).build_groups(), reducer="inline")
    data = torch.randn(3, 4, 6)
    for batch in data:
        optimizer.zero_grad()
        engine.begin_backward()
        model(batch).square().mean().backward()
        engine.finish_backward()
        optimizer.step()
        engine.after_step()
    engine.close()
    monkeypatch.undo()
    return [p.detach().clone() for p in model.parameters()], issued


def test_forcing_collectives_runs_every_reduction_of_one_rank_and_changes_nothing(
    one_process_group: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    skipped, none_issued = _train_alone(False, monkeypatch)
    forced, issued = _train_alone(True, monkeypatch)
    assert none_issued == [], "a one-rank group skips its reductions unless forced"
    assert issued.count("all_reduce") >= 3, issued  # at least one bucket's inter-node hop per step
    assert any(name.startswith("reduce_scatter") for name in issued), issued
    for a, b in zip(skipped, forced):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
