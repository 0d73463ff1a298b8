"""Micro-batched GPipe and 1F1B schedules over stage processes.

``torch.distributed.pipelining`` builds its stages once from a split module and keeps them for
the life of the schedule; the layers of a stage here change at run time (live migration), and a
stage must report per-layer times. So the schedule is written directly on point-to-point
``isend``/``recv``: sends are asynchronous and every rank blocks only on receives, whose order
follows the schedule's dependency graph, so no ordering of ranks can deadlock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

SCHEDULES = ("1f1b", "gpipe")

_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_MAX_DIMS = 8
_HEADER = 3 + _MAX_DIMS  # dtype, requires_grad, ndim, shape...


class StageLink:
    """Activation and gradient messages between this stage and its neighbours.

    Stage ``s`` runs on global rank ``rank_of_stage(s)``. An activation is sent as a small
    header (dtype, whether a gradient is expected back, shape) followed by the data, so
    receivers need no shape inference and batches of any size work.
    """

    def __init__(
        self,
        stage: int,
        num_stages: int,
        rank_of_stage: Callable[[int], int],
        device: torch.device,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.stage = stage
        self.num_stages = num_stages
        self.rank_of_stage = rank_of_stage
        self.device = device
        self.group = group
        self._pending: list[tuple[dist.Work, Any]] = []
        self.bytes_sent = 0

    def _peer(self, stage: int) -> int:
        return self.rank_of_stage(stage)

    def _isend(self, tensor: torch.Tensor, stage: int) -> None:
        tensor = tensor.contiguous()
        work = dist.isend(tensor, self._peer(stage), group=self.group)
        self._pending.append((work, tensor))  # keep the buffer alive until the send completes
        self.bytes_sent += tensor.numel() * tensor.element_size()

    def _recv(self, tensor: torch.Tensor, stage: int) -> torch.Tensor:
        dist.recv(tensor, self._peer(stage), group=self.group)
        return tensor

    def send_activation(self, value: Any) -> bool:
        """Send to the next stage; returns whether a gradient will come back for it."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"stage {self.stage} produced a {type(value).__name__} at its cut; a pipeline cut must "
                "carry one tensor (choose other split points)."
            )
        if value.dim() > _MAX_DIMS:
            raise ValueError(f"activations with more than {_MAX_DIMS} dimensions are not supported.")
        wants_grad = value.requires_grad and value.is_floating_point()
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0] = _DTYPES.index(value.dtype)
        header[1] = int(wants_grad)
        header[2] = value.dim()
        header[3 : 3 + value.dim()] = torch.tensor(value.shape, dtype=torch.int64)
        self._isend(header.to(self.device), self.stage + 1)
        self._isend(value.detach(), self.stage + 1)
        return wants_grad

    def recv_activation(self) -> torch.Tensor:
        header = self._recv(torch.empty(_HEADER, dtype=torch.int64, device=self.device), self.stage - 1)
        dtype_code, wants_grad, ndim = (int(v) for v in header[:3].tolist())
        shape = [int(v) for v in header[3 : 3 + ndim].tolist()]
        value = self._recv(torch.empty(shape, dtype=_DTYPES[dtype_code], device=self.device), self.stage - 1)
        if wants_grad:
            value.requires_grad_(True)
        return value

    def send_grad(self, grad: torch.Tensor) -> None:
        self._isend(grad, self.stage - 1)

    def recv_grad(self, like: torch.Tensor) -> torch.Tensor:
        return self._recv(torch.empty_like(like, memory_format=torch.contiguous_format), self.stage + 1)

    def wait(self) -> None:
        """Complete every outstanding send (their buffers may be freed afterwards)."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


@dataclass
class _InFlight:
    received: torch.Tensor | None
    output: Any
    wants_grad: bool


ForwardFn = Callable[[int, "torch.Tensor | None"], Any]


class PipelineSchedule:
    """Runs one optimizer step's micro-batches through this stage.

    ``forward(m, received)`` computes micro-batch ``m`` on this stage (``received`` is ``None``
    on the first stage) and returns the activation to send on, or on the last stage the scalar
    loss to backpropagate (already weighted by the micro-batch's share of the batch).
    """

    def __init__(
        self, link: StageLink, kind: str = "1f1b", on_backward_done: Callable[[], None] | None = None
    ):
        if kind not in SCHEDULES:
            raise ValueError(f"schedule={kind!r} is not one of {list(SCHEDULES)}.")
        self.link = link
        self.kind = kind
        self.on_backward_done = on_backward_done
        self.peak_in_flight = 0

    @property
    def is_first(self) -> bool:
        return self.link.stage == 0

    @property
    def is_last(self) -> bool:
        return self.link.stage == self.link.num_stages - 1

    def in_flight_limit(self, num_micro: int) -> int:
        """Micro-batches whose activations this stage holds at once under the schedule."""
        if self.kind == "gpipe":
            return num_micro
        return min(num_micro, self.link.num_stages - self.link.stage)

    # ------------------------------------------------------------------ train
    def _forward(self, m: int, forward: ForwardFn, stash: dict[int, _InFlight]) -> None:
        received = None if self.is_first else self.link.recv_activation()
        output = forward(m, received)
        wants_grad = False
        if not self.is_last:
            wants_grad = self.link.send_activation(output)
        stash[m] = _InFlight(received, output, wants_grad)
        self.peak_in_flight = max(self.peak_in_flight, len(stash))

    def _backward(self, m: int, stash: dict[int, _InFlight]) -> None:
        item = stash.pop(m)
        if self.is_last:
            if item.output.requires_grad:
                torch.autograd.backward(item.output)
        elif item.wants_grad:
            grad = self.link.recv_grad(item.output)
            torch.autograd.backward(item.output, grad)
        if self.on_backward_done is not None:
            self.on_backward_done()
        received = item.received
        if received is not None and received.requires_grad:
            grad_in = received.grad if received.grad is not None else torch.zeros_like(received)
            self.link.send_grad(grad_in)

    def train_step(self, num_micro: int, forward: ForwardFn) -> None:
        """Forward and backward of ``num_micro`` micro-batches; gradients accumulate in ``.grad``."""
        stash: dict[int, _InFlight] = {}
        if self.kind == "gpipe":
            for m in range(num_micro):
                self._forward(m, forward, stash)
            for m in range(num_micro):
                self._backward(m, stash)
        else:
            warmup = min(self.link.num_stages - self.link.stage - 1, num_micro)
            for m in range(warmup):
                self._forward(m, forward, stash)
            for m in range(warmup, num_micro):
                self._forward(m, forward, stash)
                self._backward(m - warmup, stash)
            for m in range(num_micro - warmup, num_micro):
                self._backward(m, stash)
        self.link.wait()

    # ------------------------------------------------------------------ eval
    def eval_step(self, num_micro: int, forward: ForwardFn) -> list[Any]:
        """Forward only; returns the last stage's outputs (empty list elsewhere)."""
        outputs = []
        for m in range(num_micro):
            received = None if self.is_first else self.link.recv_activation()
            output = forward(m, received)
            if self.is_last:
                outputs.append(output)
            else:
                self.link.send_activation(output)
        self.link.wait()
        return outputs
