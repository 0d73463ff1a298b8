"""Where a reducer's collectives run on the device: a side stream of their own, as DDP's reducer does.

On CUDA a gradient hook runs on the stream that produces the gradients (the compute stream). Waiting
there for a collective (``work.wait()`` on an NCCL handle makes the *current* stream wait) would hold
every later backward kernel behind that chunk's reduce-scatter or all-reduce. So the chain runs on a
side stream instead:

1. at submit, an event is recorded on the producer's stream (the bucket's gradients are written there);
2. the side stream waits for that event, and the reduce-scatter, the all-reduce behind it and the
   copies of a narrowed inter-node dtype are issued with the side stream current, so the waits between
   them order the side stream, never the compute stream;
3. an event recorded on the side stream after a job's last operation marks it done: what time bucketing
   reads as the job's completion, and what the compute stream waits for, once, before the optimizer reads
   the slices.

On the host (gloo) there is no stream: :class:`HostStream` does nothing, and the reducers keep their
blocking ``wait()`` calls. :class:`DeviceStream` is the CUDA implementation; tests drive the reducers with
a stand-in that records the protocol, since a CPU build has no streams.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class HostStream:
    """No side stream: collectives run where they are issued and ``wait()`` blocks the host (gloo)."""

    on_device = False

    def ready_marker(self) -> Any:
        """On the submitting thread: what the side stream must wait for (``None``: nothing)."""
        return None

    @contextlib.contextmanager
    def issuing(self, ready: Any) -> Iterator[None]:
        """Issue a job's collectives inside this context (after ``ready``, on the side stream)."""
        yield

    def keep_alive(self, *tensors: torch.Tensor) -> None:
        """Tell the allocator that ``tensors`` are in use on the side stream (``record_stream``)."""

    def done_marker(self) -> Any:
        """Inside :meth:`issuing`: a marker of everything issued so far on the side stream."""
        return None

    def join(self, done: Any) -> None:
        """On the consuming thread: order its current stream after ``done`` (no host wait)."""

    def enter_thread(self) -> None:
        """At the start of a communication thread: the device it issues on is the reducer's."""


class DeviceStream(HostStream):
    """A CUDA side stream for one reducer (one per engine, on the engine's device)."""

    on_device = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def ready_marker(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextlib.contextmanager
    def issuing(self, ready: Any) -> Iterator[None]:
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if ready is not None:
                self.stream.wait_event(ready)
            yield

    def keep_alive(self, *tensors: torch.Tensor) -> None:
        # the buckets are allocated on the compute stream and read here: without this the caching
        # allocator could hand their memory to the compute stream while the side stream still reads it
        for tensor in tensors:
            tensor.record_stream(self.stream)

    def done_marker(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def join(self, done: Any) -> None:
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    def enter_thread(self) -> None:
        # a new thread's current device is cuda:0; rank k's events and streams belong on cuda:k
        torch.cuda.set_device(self.device)


def comm_stream_for(device: torch.device) -> HostStream:
    """A :class:`DeviceStream` on a CUDA device, else the no-op :class:`HostStream`."""
    return DeviceStream(device) if device.type == "cuda" else HostStream()
