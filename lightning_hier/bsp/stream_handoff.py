"""The local BSP module's own CUDA stream, and the events that order it against the worker's.

On a GPU the worker (main thread, and autograd's device thread during backward) queues its kernels on
its current stream, the default one under Lightning. If the local BSP module queued its pushes,
optimizer step and pulls there too, they would wait behind the worker's forward and backward kernels
and the superstep's communication could not run beside the worker's compute, which is what
``hier_bsp`` is for. So the module issues everything on a stream of its own, and the two streams meet
only where they share tensors, through two events:

- worker -> module (:meth:`worker_hands_over`, recorded on the worker's stream after it folds a
  gradient into the aggregate, after it copies a new model out of the shared memory, before it resumes
  the module or hands it a task): the module's stream waits for it (:meth:`module_takes_over`) before
  it reads the aggregate, overwrites the published model, or runs the task;
- module -> worker (:meth:`module_hands_over`, recorded on the module's stream after it publishes a
  model or finishes a task): the worker's stream waits for it (:meth:`worker_takes_over`) before it
  copies the model into its parameters or uses the task's result.

One event per direction is enough: a stream runs in order, so waiting for its newest record waits for
everything it queued before. Records and waits happen under the shared memory's lock, so no record
races a wait on the same event. :meth:`module_synchronize` waits for the module's stream alone (the
superstep's timings, and the read-out buffers before they are zeroed), never for the worker's kernels.

Off CUDA every method does nothing: host kernels have run by the time their call returns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves


class StreamHandoff:
    """Orders one worker's and its local BSP module's device work on ``device`` (no-op off CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream: torch.cuda.Stream | None = torch.cuda.Stream(device) if self.cuda else None
        self._to_module = torch.cuda.Event() if self.cuda else None
        self._to_worker = torch.cuda.Event() if self.cuda else None

    @contextlib.contextmanager
    def module_stream(self) -> Iterator[None]:
        """Make the module's stream current for the calling thread (the local BSP module's ``run``)."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def worker_hands_over(self) -> None:
        """Worker side, lock held: what the worker queued so far is for the module to wait on."""
        if self._to_module is not None:
            self._to_module.record(torch.cuda.current_stream(self.device))

    def module_takes_over(self) -> None:
        """Module side, lock held: the module's later work waits for the worker's last hand-over."""
        if self.stream is not None:
            self.stream.wait_event(self._to_module)

    def module_hands_over(self) -> None:
        """Module side, lock held: what the module queued so far is for the worker to wait on."""
        if self._to_worker is not None:
            self._to_worker.record(self.stream)

    def worker_takes_over(self) -> None:
        """Worker side, lock held: the worker's later work waits for the module's last hand-over."""
        if self._to_worker is not None:
            torch.cuda.current_stream(self.device).wait_event(self._to_worker)

    def worker_takes_result(self, result: Any) -> Any:
        """Worker side, lock held, for what a task on the module's thread returned: wait for it, and tell
        the caching allocator that its device tensors are now used on the worker's stream too (made on
        the module's stream, they would otherwise go back to that stream's pool when freed while the
        worker's kernels may still read them)."""
        self.worker_takes_over()
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            for leaf in tree_leaves(result):
                if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
                    leaf.record_stream(stream)
        return result

    def module_synchronize(self) -> None:
        """Block the module's thread until its own stream has run everything queued on it."""
        if self.stream is not None:
            self.stream.synchronize()
