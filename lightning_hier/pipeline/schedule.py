"""Micro-batched GPipe and 1F1B schedules over stage processes.

``torch.distributed.pipelining`` builds its stages once from a split module and keeps them for
the life of the schedule; the layers of a stage here change at run time (live migration), and a
stage must report per-layer times. So the schedule is written directly on point-to-point
operations, following the rules torch's own schedules follow for NCCL:

- in 1F1B's steady state each forward send is paired with the matching backward receive, and
  each backward send with the next forward receive, in one ``batch_isend_irecv``; the two
  neighbours post the mirror pair, so neither waits on a send queued behind its own receive
  (unpaired, stage ``s`` sending an activation while stage ``s+1`` sends a gradient deadlocks
  NCCL once messages are large);
- a send buffer is released as soon as its send completes (at the batch's wait, or for lone
  warm-up sends at the next exchange), not at the end of the step;
- an activation's shape, dtype and whether a gradient comes back travel ahead of it as a small
  header. The header is host data, so it goes over the group's CPU backend (the device rule of
  :mod:`lightning_hier.topology`) and never enters the NCCL stream: the receiver reads it, then
  posts the data receive inside the paired batch. Gradients need no header: they have the shape
  of the activation they belong to. The receive of the next header is posted as soon as the
  current activation has arrived, so it completes while the stage computes: on gloo a message
  posted for late waits for the sender's communication thread, which on a busy CPU core costs a
  scheduler slice on the critical path (measured: 3-4 ms per micro-batch on 2 cores). For the same
  reason, on gloo, where the next activation's spec is known from memory (``static_shapes``), its
  data receive is posted ahead too, outside the pair; NCCL keeps the pairs (a receive posted
  early would queue the stage's next sends behind it on the communicator's stream).
- on gloo a stage posts its gradient send as soon as its backward ends, before it waits for the next
  activation's header: the previous stage, blocked on that gradient, then receives it without waiting
  for this stage to wake up on the header and post the pair (``torch.distributed.pipelining``'s stages,
  which send no headers, post the pair at once). NCCL keeps the pair.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_hier.pipeline.activation_store import ActivationMeter
from lightning_hier.pipeline.warmup import warmup_counts
from lightning_hier.topology import runs_as_cuda

if TYPE_CHECKING:
    from lightning_hier.pipeline.weight_grad import WeightGradients

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


_HEADER_TAG = 1  # headers and data are separate message streams on gloo


class StageLink:
    """Activation and gradient messages between this stage and its neighbours.

    Stage ``s`` runs on global rank ``rank_of_stage(s)``. Methods named ``*_op`` return the
    ``P2POp`` s of one exchange; :meth:`exchange` posts them together and waits.
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
        self._lone_sends: list[tuple[dist.Work, torch.Tensor]] = []  # work, buffer kept alive until done
        self._pending_header: tuple[dist.Work, torch.Tensor] | None = None  # see expect_header
        # see expect_activation: (work, buffer, spec) of the next activation's data
        self._pending_activation: tuple[dist.Work, torch.Tensor, tuple[list[int], torch.dtype, bool]] | None
        self._pending_activation = None
        # gloo only: on NCCL an early receive would hold the stage's next sends behind it on the stream
        self.posts_data_ahead = torch.device(device).type == "cpu"
        # gloo only, emulated NCCL included out: a gradient send goes out alone, ahead of its pair
        self.sends_gradients_early = not runs_as_cuda(torch.device(device))
        self.bytes_sent = 0
        self.headers_sent = 0
        self.headers_received = 0
        self.activations_posted_ahead = 0
        self.forget_specs()

    def _peer(self, stage: int) -> int:
        return self.rank_of_stage(stage)

    def open_device_channel(self) -> None:
        """One collective of a device tensor over the whole group, so that its device communicator exists
        before any exchange (every rank calls this, at setup; nothing with one stage).

        NCCL makes a group's communicator at its first device operation, unless the process group was
        initialised with a ``device_id``, and torch requires every rank of the group to take part when
        that first operation is a ``batch_isend_irecv``. The schedules' first exchange is between two
        stages only, and with three or more the others are waiting for a header that comes after it
        (stage 2 for the one stage 1 sends once its activation from stage 0 has arrived): without the
        communicator, stages 0 and 1 would wait in that exchange for stage 2, and stage 2 for stage 1.
        """
        if self.num_stages > 1:
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)

    # ------------------------------------------------------------------ headers (host, CPU backend)
    def forget_specs(self) -> None:
        """Drop the remembered activation specs (the cut moved: what crosses it is something else)."""
        if self._pending_activation is not None:  # posted for the old cut's spec: never between steps
            raise RuntimeError("hier_pipeline: an activation receive is still posted while the cut moves.")
        self._sent_specs: dict[Hashable, tuple[int, ...]] = {}
        self._received_specs: dict[Hashable, tuple[list[int], torch.dtype, bool]] = {}

    def send_header(self, value: Any, key: Hashable | None = None) -> bool:
        """Announce an activation to the next stage; returns whether a gradient will come back.

        With a ``key`` (``static_shapes``: the micro-batch's input signature, the same on both sides),
        the header goes only the first time the key is seen; afterwards the activation must have the
        spec it had then, and both sides take it from memory.
        """
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"stage {self.stage} produced a {type(value).__name__} at its cut; a pipeline cut must "
                "carry one tensor (choose other split points)."
            )
        if value.dim() > _MAX_DIMS:
            raise ValueError(f"activations with more than {_MAX_DIMS} dimensions are not supported.")
        wants_grad = value.requires_grad and value.is_floating_point()
        spec = (_DTYPES.index(value.dtype), int(wants_grad), value.dim(), *value.shape)
        if key is not None:
            known = self._sent_specs.get(key)
            if known == spec:
                return wants_grad
            if known is not None:
                raise RuntimeError(
                    f"hier_pipeline(static_shapes=True): stage {self.stage} sends an activation of spec "
                    f"{_describe(spec)} for a micro-batch shaped like an earlier one that sent "
                    f"{_describe(known)}; the next stage expects the earlier one. Activation shapes at "
                    "stage cuts depend on more than the input shapes here: use static_shapes=False."
                )
            self._sent_specs[key] = spec
        header = torch.tensor([*spec, *[0] * (_HEADER - len(spec))], dtype=torch.int64)
        work = dist.isend(header, self._peer(self.stage + 1), group=self.group, tag=_HEADER_TAG)
        self._lone_sends.append((work, header))
        self.headers_sent += 1
        return wants_grad

    def knows_spec(self, key: Hashable | None) -> bool:
        """Whether the spec of an activation with ``key`` comes from memory (no header is sent for it)."""
        return key is not None and key in self._received_specs

    def expect_header(self) -> None:
        """Post the receive of the next header now, so that it completes whenever the previous stage
        sends it. On gloo a message lands only after the receiver posted its receive and the sender's
        communication thread answered; posted late, while the sender computes, that answer waits for a
        scheduler slice (3-4 ms on a busy CPU core), on the pipeline's critical path."""
        if self._pending_header is None:
            header = torch.empty(_HEADER, dtype=torch.int64)
            work = dist.irecv(header, self._peer(self.stage - 1), group=self.group, tag=_HEADER_TAG)
            self._pending_header = (work, header)

    def recv_header(self, key: Hashable | None = None) -> tuple[list[int], torch.dtype, bool]:
        """The spec of the next activation: read from the previous stage, or (a known ``key``) from
        memory, as the sender decides for the same key."""
        if self.knows_spec(key):
            return self._received_specs[key]
        self.expect_header()
        assert self._pending_header is not None
        work, header = self._pending_header
        self._pending_header = None
        work.wait()
        self.headers_received += 1
        dtype_code, wants_grad, ndim = (int(v) for v in header[:3].tolist())
        spec = [int(v) for v in header[3 : 3 + ndim].tolist()], _DTYPES[dtype_code], bool(wants_grad)
        if key is not None:
            self._received_specs[key] = spec
        return spec

    # ------------------------------------------------------------------ data (device)
    def expect_activation(self, spec: tuple[list[int], torch.dtype, bool]) -> None:
        """Post the receive of the next activation's data now (its ``spec`` known from memory), for the
        reason of :meth:`expect_header`: posted before the previous stage sends, the data lands without
        waiting for that stage's communication thread."""
        if self._pending_activation is None:
            value = self._activation_buffer(spec)
            work = dist.irecv(value, self._peer(self.stage - 1), group=self.group)
            self._pending_activation = (work, value, spec)
            self.activations_posted_ahead += 1

    def take_expected_activation(
        self,
    ) -> tuple[dist.Work, torch.Tensor, tuple[list[int], torch.dtype, bool]] | None:
        """The receive :meth:`expect_activation` posted (work, buffer, spec), handed over once."""
        pending, self._pending_activation = self._pending_activation, None
        return pending

    @property
    def receives_pending(self) -> int:
        """Receives posted ahead and not yet taken (header and data): zero between steps."""
        return int(self._pending_header is not None) + int(self._pending_activation is not None)

    def send_activation_op(self, value: torch.Tensor) -> dist.P2POp:
        return self._send_op(value.detach(), self.stage + 1)

    def recv_activation_op(
        self, header: tuple[list[int], torch.dtype, bool]
    ) -> tuple[dist.P2POp, torch.Tensor]:
        value = self._activation_buffer(header)
        return dist.P2POp(dist.irecv, value, self._peer(self.stage - 1), self.group), value

    def _activation_buffer(self, spec: tuple[list[int], torch.dtype, bool]) -> torch.Tensor:
        shape, dtype, _ = spec
        return torch.empty(shape, dtype=dtype, device=self.device)

    def send_grad_op(self, grad: torch.Tensor) -> dist.P2POp:
        return self._send_op(grad, self.stage - 1)

    def recv_grad_op(self, like: torch.Tensor) -> tuple[dist.P2POp, torch.Tensor]:
        grad = torch.empty_like(like, memory_format=torch.contiguous_format)
        return dist.P2POp(dist.irecv, grad, self._peer(self.stage + 1), self.group), grad

    def _send_op(self, tensor: torch.Tensor, stage: int) -> dist.P2POp:
        tensor = tensor.contiguous()
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return dist.P2POp(dist.isend, tensor, self._peer(stage), self.group)

    def exchange(
        self,
        ops: list[dist.P2POp],
        posted: Sequence[dist.Work] = (),
        idle: Callable[[Callable[[], bool]], None] | None = None,
    ) -> None:
        """Post ``ops`` as one batch and wait for them and for the ``posted`` receives (on CUDA the
        stream waits, not the host). ``idle(done)``, if given, runs between posting and waiting and may
        work until ``done()`` says every message has completed. On gloo a send's or receive's work
        reports completion only once waited (torch 2.13), so there ``done()`` stays false and ``idle``
        does all the work it has before this waits."""
        self._release_finished_sends()
        works = list(dist.batch_isend_irecv(ops)) if ops else []
        if idle is not None:
            waiting = [*works, *posted]
            idle(lambda: all(work.is_completed() for work in waiting))
        for work in works:
            work.wait()
        for work in posted:
            work.wait()

    def post_receives(self, ops: list[dist.P2POp]) -> list[dist.Work]:
        """Post receives without waiting; the caller waits for the returned works when it needs the data."""
        self._release_finished_sends()
        return list(dist.batch_isend_irecv(ops)) if ops else []

    def post_early_sends(self, ops: list[dist.P2POp]) -> list[dist.Work]:
        """Post sends now, ahead of the exchange that waits for the returned works (the caller keeps
        ``ops``, and so their buffers, until then)."""
        return list(dist.batch_isend_irecv(ops)) if ops else []

    def post_sends(self, ops: list[dist.P2POp]) -> None:
        """Post sends that no receive of this stage is paired with; their buffers go when done."""
        self._release_finished_sends()
        if ops:
            works = dist.batch_isend_irecv(ops)
            self._lone_sends.extend((work, op.tensor) for work, op in zip(works, ops))

    def _release_finished_sends(self) -> None:
        # on gloo a send completes only in ``wait``: its buffer stays until :meth:`wait` ends the step
        self._lone_sends = [(w, t) for w, t in self._lone_sends if not w.is_completed()]

    def wait(self) -> None:
        """Complete every outstanding send (their buffers are freed afterwards)."""
        for work, _ in self._lone_sends:
            work.wait()
        self._lone_sends.clear()


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
        # the last stage's backward of a micro-batch's loss (a LightningModule's own ``backward`` where
        # the user overrode it)
        self.loss_backward: Callable[[torch.Tensor], Any] = torch.autograd.backward
        self.peak_in_flight = 0
        # With a memory policy: the received input and the output of every micro-batch in flight
        # are held until its backward whatever the layers' policies, so the meter counts them.
        self.meter: ActivationMeter | None = None
        self.held_bytes = 0  # of the last micro-batch stashed, storages counted once
        self.keys: Sequence[Hashable] | None = None
        self.num_micro = 0  # of the step running
        # 1F1B: extra forwards per stage before its first backward (pipeline/warmup.py), the same list on
        # every stage: a stage's receives follow the previous stage's count
        self.extra_warmup: list[int] = []
        # activations whose receive is posted, by micro-batch: (buffer, works still to wait for)
        self._inbox: dict[int, tuple[torch.Tensor | None, list[dist.Work]]] = {}
        self._recv_next = 0  # the next activation whose receive is not posted yet (they go in order)
        # called once per training step, right after this stage issued its last message of the step (the
        # first stage: its last gradient's receive, before its last backward; the others: their last
        # sends): what goes out after every message of the step keeps the ranks' one issuing order
        self.after_messages: Callable[[], None] | None = None
        # a split backward (pipeline/weight_grad.py): the engine sets both; ``split_backward`` per step
        self.weight_grads: WeightGradients | None = None
        self.split_backward = False
        # micro-batches whose weights' pass may wait (each holds its autograd graph until then)
        self.max_deferred = 1
        self._split: WeightGradients | None = None  # of the step running

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
        return self.warmups(num_micro)[self.link.stage]

    def warmups(self, num_micro: int) -> list[int]:
        """Forwards each stage runs before its first backward (1F1B: ``S - s`` plus the extra ones)."""
        return warmup_counts(self.link.num_stages, num_micro, self.extra_warmup)

    # ------------------------------------------------------------------ pieces of a step
    def _key(self, m: int) -> Hashable | None:
        return self.keys[m] if self.keys is not None else None

    def _recv_activation_ops(self, m: int) -> tuple[list[dist.P2POp], torch.Tensor | None, list[dist.Work]]:
        """The receive of activation ``m``: the op to post (its header is read first, over the host
        backend), or the receive posted ahead (:meth:`_expect_next`) to wait for."""
        if self.is_first:
            return [], None, []
        if m != self._recv_next:
            raise AssertionError(f"activation {m} received out of order (next is {self._recv_next})")
        self._recv_next = m + 1
        posted = self.link.take_expected_activation()
        if posted is not None:
            work, value, header = posted
            ops, waits = [], [work]
        else:
            header = self.link.recv_header(self._key(m))
            op, value = self.link.recv_activation_op(header)
            ops, waits = [op], []
        if header[2]:
            value.requires_grad_(True)
        return ops, value, waits

    def _expect_next(self, m: int) -> None:
        """Activation ``m`` has arrived: post the receive of the next one's header now, to complete while
        this stage computes (:meth:`StageLink.expect_header`), or where its spec is known from memory,
        on gloo, the receive of its data (:meth:`StageLink.expect_activation`). Posted after ``m``'s data,
        so the messages of a cut are received in the order they are sent."""
        if self.is_first or m + 1 >= self.num_micro or self._recv_next > m + 1:
            return  # the first stage receives nothing; the next one's receive may be posted already
        key = self._key(m + 1)
        if not self.link.knows_spec(key):
            self.link.expect_header()
        elif self.link.posts_data_ahead:
            self.link.expect_activation(self.link.recv_header(key))  # from memory: no message

    def _compute_forward(
        self, m: int, received: torch.Tensor | None, forward: ForwardFn, stash: dict[int, _InFlight]
    ) -> list[dist.P2POp]:
        """Forward of micro-batch ``m``; returns the send of its activation (empty on the last stage)."""
        self._expect_next(m)
        split = self._split
        if split is not None and received is not None and received.requires_grad and self._splits_micro(m):
            with split.recording(m):
                output = forward(m, received)
        else:
            output = forward(m, received)
        sends: list[dist.P2POp] = []
        wants_grad = False
        if not self.is_last:
            wants_grad = self.link.send_header(output, self._key(m))
            sends.append(self.link.send_activation_op(output))
        item = stash[m] = _InFlight(received, output, wants_grad)
        self.peak_in_flight = max(self.peak_in_flight, len(stash))
        if self.meter is not None:
            self.held_bytes = self.meter.hold(item, (received, output))
        return sends

    def _recv_grad_ops(
        self, m: int, stash: dict[int, _InFlight]
    ) -> tuple[list[dist.P2POp], torch.Tensor | None]:
        item = stash[m]
        if self.is_last or not item.wants_grad:
            return [], None
        op, grad = self.link.recv_grad_op(item.output)
        return [op], grad

    def _compute_backward(
        self, m: int, grad: torch.Tensor | None, stash: dict[int, _InFlight]
    ) -> list[dist.P2POp]:
        """Backward of micro-batch ``m``; returns the send of its input gradient (if any)."""
        item = stash.pop(m)
        split = self._split
        if split is not None and split.has_record(m):
            return self._split_backward(m, grad, item, split)
        return self._plain_backward(item, grad)

    def _plain_backward(self, item: _InFlight, grad: torch.Tensor | None) -> list[dist.P2POp]:
        if self.is_last:
            if item.output.requires_grad:
                self.loss_backward(item.output)
        elif grad is not None:
            torch.autograd.backward(item.output, grad)
        if self.on_backward_done is not None:
            self.on_backward_done()
        received = item.received
        if received is None or not received.requires_grad:
            return []
        grad_in = received.grad if received.grad is not None else torch.zeros_like(received)
        return [self.link.send_grad_op(grad_in)]

    def _split_backward(
        self, m: int, grad: torch.Tensor | None, item: _InFlight, split: WeightGradients
    ) -> list[dist.P2POp]:
        """The input pass of micro-batch ``m`` only: its weights' pass waits (:meth:`_fill`)."""
        received = item.received
        assert received is not None
        output = item.output
        differentiable = isinstance(output, torch.Tensor) and output.requires_grad  # may be ``received``
        if differentiable and (self.is_last or grad is not None):
            try:
                grad_in = split.input_backward(m, output, grad if not self.is_last else None, received)
            except RuntimeError as error:
                if not split.refused(m, error):
                    raise
                return self._plain_backward(item, grad)
        else:  # nothing to backpropagate (a skipped micro-batch's loss, an output no stage needs)
            split.drop(m)
            grad_in = torch.zeros_like(received)
        if self.on_backward_done is not None:
            self.on_backward_done()
        return [self.link.send_grad_op(grad_in)]

    def _exchange(self, ops: list[dist.P2POp], posted: Sequence[dist.Work] = ()) -> None:
        """:meth:`StageLink.exchange`, running deferred weights' passes while it waits (split backward)."""
        if self._split is None:
            self.link.exchange(ops, posted)
        else:
            self.link.exchange(ops, posted, idle=self._fill)

    def _fill(self, done: Callable[[], bool]) -> None:
        """While this stage's messages are in flight: the weights' passes beyond ``max_deferred`` first,
        then more of them until the messages complete (on gloo, where completion shows only in ``wait``,
        all of them: see :meth:`StageLink.exchange`)."""
        split = self._split
        if split is None:
            return
        while len(split.pending) > self.max_deferred:
            split.run_oldest()
        while split.pending and not done():
            split.run_oldest()

    def _splits_micro(self, m: int) -> bool:
        """Which micro-batches split: the last ``S - 1``, whose input gradients are the drain's critical
        path (the previous stage waits for them with nothing else to do). Splitting the others gains
        nothing where the wait they would fill cannot be seen: on gloo a message shows as arrived only once
        waited, so a weights' pass runs before every wait, also where the message is already there.
        Recording a forward's module calls also costs tens of microseconds per call. In two runs on a 2-core
        CPU switching every 5 steps (a skewed stack of 9 narrow blocks, then 7 wide ones, 2 stages, 4
        micro-batches), the drain's split alone made the step 1.038x faster in both, splitting all 1.01x
        and 1.03x."""
        stages, num_micro = self.link.num_stages, self.num_micro
        return m >= num_micro - (stages - 1)

    def _splits(self) -> WeightGradients | None:
        """The split backward for this step, where it applies: a stage that receives activations (the
        first one has no input gradient to send), the last stage's loss through plain autograd (a user's
        ``backward`` runs as written), grad mode, no user hook on a parameter."""
        split = self.weight_grads
        if (
            split is None
            or not self.split_backward
            or not split.usable
            or self.is_first
            or not torch.is_grad_enabled()
            or (self.is_last and self.loss_backward is not torch.autograd.backward)
            or split.hooks_on_parameters()
        ):
            return None
        return split

    # ------------------------------------------------------------------ train
    def train_step(self, num_micro: int, forward: ForwardFn, keys: Sequence[Hashable] | None = None) -> None:
        """Forward and backward of ``num_micro`` micro-batches; gradients accumulate in ``.grad``.
        ``keys``: per micro-batch, what its activations' specs depend on (``static_shapes``)."""
        self._start(num_micro, keys)
        self._split = self._splits()
        try:
            if self.kind == "gpipe":
                self._gpipe(num_micro, forward)
            else:
                self._one_f_one_b(num_micro, forward)
            if self._split is not None:
                self._split.run_all()  # the optimizer step reads every gradient
        finally:
            if self._split is not None:
                self._split.discard()
            self._split = None
        self.link.wait()

    def _gpipe(self, num_micro: int, forward: ForwardFn) -> None:
        """All forwards, then all backwards: each link carries one direction at a time."""
        stash: dict[int, _InFlight] = {}
        for m in range(num_micro):
            recv_ops, received, posted = self._recv_activation_ops(m)
            self.link.exchange(recv_ops, posted)
            self.link.post_sends(self._compute_forward(m, received, forward, stash))
        for m in range(num_micro):
            recv_ops, grad = self._recv_grad_ops(m, stash)
            self._exchange(recv_ops)
            if m == num_micro - 1 and self.is_first:
                self._messages_done()
            self.link.post_sends(self._compute_backward(m, grad, stash))
        if not self.is_first:
            self._messages_done()

    def _one_f_one_b(self, num_micro: int, forward: ForwardFn) -> None:
        """Warm-up forwards, then backward/forward pairs with paired exchanges, then backwards.

        Stage ``s`` runs ``w[s]`` forwards before its first backward (1F1B: ``S - s``, more with
        ``extra_warmup``, :func:`~lightning_hier.pipeline.warmup.warmup_counts`). In the steady state
        it posts {send activation f, receive gradient b} and then {send gradient b, receive the
        activation the previous stage sends with its receive of gradient b}; the neighbours post the
        mirror images of these pairs. Where the previous stage runs more warm-up forwards than this
        one needs, this stage receives the surplus ahead, without waiting, before its first pair.
        """
        stash: dict[int, _InFlight] = {}
        counts = self.warmups(num_micro)
        warmup = counts[self.link.stage]
        # the previous stage sends activation b + lead together with its receive of gradient b
        lead = counts[self.link.stage - 1] - 1 if not self.is_first else 0
        fwd = bwd = 0
        forward_sends: list[dist.P2POp] = []
        for i in range(warmup):
            recv_ops, received, posted = self._recv_activation_ops(fwd)
            self.link.exchange(recv_ops, posted)
            forward_sends = self._compute_forward(fwd, received, forward, stash)
            fwd += 1
            if i < warmup - 1:  # the last warm-up send is paired with the first gradient receive
                self.link.post_sends(forward_sends)
                forward_sends = []
        backward_sends: list[dist.P2POp] = []
        while bwd < num_micro:
            recv_ops, grad = self._recv_grad_ops(bwd, stash)
            self._exchange(forward_sends + backward_sends + recv_ops)
            forward_sends = []
            if bwd == num_micro - 1 and self.is_first:  # nothing left to send: every forward ran
                self._messages_done()
            backward_sends = self._compute_backward(bwd, grad, stash)
            paired = bwd + lead
            bwd += 1
            if fwd < num_micro:
                recv_ops, posted = [], []
                sent: list[dist.Work] = []
                if backward_sends and self.link.sends_gradients_early:
                    # gloo: out before the wait for the next header (module docstring); waited below
                    sent = self.link.post_early_sends(backward_sends)
                if not self.is_first:
                    recv_ops, posted = self._receive_paired(paired, num_micro)
                self._exchange(([] if sent else backward_sends) + recv_ops, [*posted, *sent])
                backward_sends = []
                received, waits = self._inbox.pop(fwd) if fwd in self._inbox else (None, [])
                if waits:
                    self._exchange([], waits)
                forward_sends = self._compute_forward(fwd, received, forward, stash)
                fwd += 1
        self.link.post_sends(forward_sends + backward_sends)
        if not self.is_first:
            self._messages_done()

    def _messages_done(self) -> None:
        if self.after_messages is not None:
            self.after_messages()

    def _receive_paired(self, paired: int, num_micro: int) -> tuple[list[dist.P2POp], list[dist.Work]]:
        """The receive of activation ``paired``, to post with this stage's gradient send (the previous stage
        posts its send with its receive of that gradient); the previous stage's surplus warm-up
        activations before it are received ahead, without waiting. Each lands in the inbox."""
        while self._recv_next < min(paired, num_micro):
            self._receive_ahead(self._recv_next)
        if paired >= num_micro or self._recv_next != paired:
            return [], []
        recv_ops, value, posted = self._recv_activation_ops(paired)
        self._inbox[paired] = (value, [])  # the exchange waits for it
        return recv_ops, posted

    def _receive_ahead(self, m: int) -> None:
        """Post activation ``m``'s receive now and wait for it when its forward runs."""
        recv_ops, value, posted = self._recv_activation_ops(m)
        self._inbox[m] = (value, posted + self.link.post_receives(recv_ops))

    def _start(self, num_micro: int, keys: Sequence[Hashable] | None) -> None:
        self._inbox.clear()  # empty unless a step failed half-way; its receives are not this step's
        self.keys, self.num_micro = keys, num_micro
        self._recv_next = 0

    # ------------------------------------------------------------------ eval
    def eval_step(
        self, num_micro: int, forward: ForwardFn, keys: Sequence[Hashable] | None = None
    ) -> list[Any]:
        """Forward only; returns the last stage's outputs (empty list elsewhere)."""
        self._start(num_micro, keys)
        outputs = []
        for m in range(num_micro):
            recv_ops, received, posted = self._recv_activation_ops(m)
            self.link.exchange(recv_ops, posted)
            if received is not None:
                received.requires_grad_(False)
            self._expect_next(m)
            output = forward(m, received)
            if self.is_last:
                outputs.append(output)
            else:
                self.link.send_header(output, self._key(m))
                self.link.post_sends([self.link.send_activation_op(output)])
        self.link.wait()
        return outputs


def _describe(spec: tuple[int, ...]) -> str:
    dtype, wants_grad, ndim, *shape = spec
    return f"{_DTYPES[dtype]} {tuple(shape[:ndim])}" + (" (with gradient)" if wants_grad else "")
