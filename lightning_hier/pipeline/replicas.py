"""Pipeline x data parallel: ``R`` replicas of an ``S``-stage pipeline on ``W = R x S`` processes.

**Layout.** Replica ``r`` runs on the contiguous ranks ``r*S .. r*S + S - 1``; inside it stage ``s`` runs on
rank ``r*S + S - 1 - s``, so replica 0's last stage, which computes the loss, is rank 0 (where Lightning
logs, shows the progress bar and writes checkpoints), and with one replica the layout is the plain
pipeline's. Lightning numbers ranks node by node (``rank = node_rank x devices + local_rank``), so a pipeline
of at most one node's devices keeps its activations inside a node, and a pipeline of at least one node's
devices (``S >= devices``) puts the replicas of every stage on different nodes: the gradient all-reduce of
each stage crosses nodes, as ``ddp``'s does.

**Groups** (built through :func:`~lightning_hier.topology.subset_group`, once per process, every rank
building each in the same order): the *pipeline* group of each replica (its stages: activations, the step's
loss, migrations, the norm for clipping, tied parameters' sums) and the *replica* group of each stage (its
``R`` replicas: the gradient average, the sync of logged values). With one replica there is no replica
group, and the pipeline group is every rank, as before.

Every replica holds the same layers on the same stages: rebalancing decides from the times of every
replica (averaged) and each replica migrates the same layers between its own stages; the replicas start
from replica 0's values and step with the same averaged gradients, so they stay equal. Buffers (BatchNorm's
running statistics) follow ``ddp``'s ``broadcast_buffers=True``: each stage of replica 0 sends its buffers to
the same stage of the other replicas at the points where ``ddp`` sends rank 0's
(:class:`~lightning_hier.buffer_broadcast.RootBuffers`), and a memory plan (``memory_limit``) is the one
replica 0's stage decides (:func:`agree_with_replica_0`).

**Gradient average.** On the step that ends an accumulation window, each bucket's all-reduce over the
replicas starts from the gradient hooks of the last micro-batch's backward, as soon as every gradient in it
is final, and the step waits for them before on_after_backward (:class:`ReplicaGradients`); otherwise the
average runs after the backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_hier.sliced.comm_stream import HostStream, comm_stream_for
from lightning_hier.topology import all_ranks_group, subset_group

# gradients averaged per all-reduce at most (one flat buffer each): the copy it takes stays bounded
BUCKET_BYTES = 32 << 20


@dataclass(frozen=True)
class ReplicaLayout:
    """Where stage ``s`` of replica ``r`` runs: rank ``r * stages + stages - 1 - s`` (module docstring)."""

    stages: int
    replicas: int = 1

    def __post_init__(self) -> None:
        if self.stages < 1 or self.replicas < 1:
            raise ValueError(f"a pipeline needs stages >= 1 and replicas >= 1, got {self}.")

    @classmethod
    def of_world(cls, world_size: int, stages: int | None) -> ReplicaLayout:
        """``world_size`` processes as pipelines of ``stages`` (``None``: one pipeline over all of them).
        Raises ``ValueError`` (before any process group exists) when ``stages`` does not divide it."""
        if stages is None:
            return cls(world_size, 1)
        if world_size % stages:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(
                f"hier_pipeline runs world_size / stages replicas of the pipeline: stages={stages} but the "
                f"Trainer launches {world_size} process(es) (devices x num_nodes), which stages must divide. "
                f"Valid values: {divisors} (or None: one pipeline over every process)."
            )
        return cls(stages, world_size // stages)

    @property
    def world_size(self) -> int:
        return self.stages * self.replicas

    def rank(self, replica: int, stage: int) -> int:
        return replica * self.stages + self.stages - 1 - stage

    def replica_of(self, rank: int) -> int:
        return rank // self.stages

    def stage_of(self, rank: int) -> int:
        return self.stages - 1 - rank % self.stages

    def pipeline_ranks(self, replica: int) -> list[int]:
        """The ranks of ``replica``'s stages, ascending (a group's order: position ``S - 1 - stage``)."""
        return list(range(replica * self.stages, (replica + 1) * self.stages))

    def replica_ranks(self, stage: int) -> list[int]:
        """The ranks holding ``stage`` in every replica, in replica order."""
        return [self.rank(replica, stage) for replica in range(self.replicas)]

    def position(self, stage: int) -> int:
        """``stage``'s index in its pipeline group (the order of a gather over it)."""
        return self.stages - 1 - stage


@dataclass
class ReplicaGroups:
    """This rank's two groups: its pipeline's stages and its stage's replicas (``None`` with one replica)."""

    pipeline: Any
    replicas: Any | None


def build_groups(layout: ReplicaLayout, rank: int, timeout: timedelta | None = None) -> ReplicaGroups:
    """This rank's groups (collective the first time: every rank calls it, and builds every replica's
    pipeline group and every stage's replica group, in the same order)."""
    if layout.replicas == 1:
        return ReplicaGroups(all_ranks_group(timeout), None)
    pipeline = replicas = None
    for replica in range(layout.replicas):
        group = subset_group(layout.pipeline_ranks(replica), timeout, role="pipeline")
        if replica == layout.replica_of(rank):
            pipeline = group
    for stage in range(layout.stages):
        group = subset_group(layout.replica_ranks(stage), timeout, role="pipeline_replicas")
        if stage == layout.stage_of(rank):
            replicas = group
    return ReplicaGroups(pipeline, replicas)


@torch.no_grad()
def broadcast_from_replica_0(
    tensors: Sequence[torch.Tensor], layout: ReplicaLayout, stage: int, group: Any
) -> None:
    """Give this stage's ``tensors`` (its parameters and buffers, the same list in every replica) replica 0's
    values, as ``ddp`` starts every rank from rank 0's module (collective over the stage's replicas)."""
    for tensor in tensors:
        if tensor.numel():
            dist.broadcast(tensor, src=layout.rank(0, stage), group=group)


class _OverlappedStep:
    """One step's all-reduces started from the gradient hooks (see :meth:`ReplicaGradients.arm`)."""

    def __init__(self, params: Sequence[nn.Parameter], buckets: list[list[int]], final_backward: int) -> None:
        self.params = list(params)
        self.buckets = buckets
        self.bucket_of = {i: b for b, members in enumerate(buckets) for i in members}
        self.missing = [len(members) for members in buckets]
        self.final_backward = final_backward
        self.backwards_done = 0
        self.hooked: set[int] = set()
        self.next_bucket = 0
        self.flats: list[torch.Tensor] = []
        self.works: list[Any] = []
        self.done: Any = None
        self.handles: list[Any] = []
        self.from_hooks = 0
        self.repeated = False  # a gradient accumulated twice in the final backward (ReplicaGradients.finish)


class ReplicaGradients:
    """Averages a stage's gradients over its replicas before the optimizer step, as ``ddp`` averages them.

    A parameter some replica has a gradient for gets the average in every replica (a zero gradient where one
    had none); one no replica has a gradient for keeps ``grad=None`` (the optimizer skips it, as under
    ``ddp``). Which ones have a gradient travels as host flags over the group's CPU backend (no read of a
    device value); the gradients go in flat buckets per dtype, divided by the replica count and summed (as
    DDP's default hook does), each all-reduce issued on a side stream of its own on CUDA, which the compute
    stream waits for once, without a host wait (``sliced/comm_stream.py``).

    Two ways, with the same sums: :meth:`average` after the backward, or, on a step that ends an accumulation
    window, :meth:`arm` before it: then each bucket's all-reduce starts from the gradient hooks of the last
    micro-batch's backward, while the earlier layers' backward still runs, and :meth:`finish` waits."""

    def __init__(
        self, group: Any, replicas: int, device: torch.device, bucket_bytes: int = BUCKET_BYTES
    ) -> None:
        self.group = group
        self.replicas = replicas
        self.device = device
        self.bucket_bytes = bucket_bytes
        self._stream: HostStream | None = None
        self.averaged_steps = 0
        self.overlapped_steps = 0  # steps whose average started in the backward
        self.buckets_from_hooks = 0  # buckets whose all-reduce a gradient hook started, over the run
        self.repeated_steps = 0  # armed steps averaged again after the backward (see finish)
        self._step: _OverlappedStep | None = None
        self._layout_key: tuple[int, ...] = ()
        self._layout: list[list[int]] = []
        self.finished = False  # this step's average is done (reset by reset() at the next step)

    def _comm_stream(self) -> HostStream:
        if self._stream is None:
            self._stream = comm_stream_for(self.device)
        return self._stream

    @torch.no_grad()
    def average(self, params: Sequence[nn.Parameter]) -> None:
        """Average the gradients of ``params`` (this stage's trainable parameters, the same list in every
        replica) over the replicas (collective over the stage's replicas)."""
        flags = torch.tensor([int(p.grad is not None) for p in params], dtype=torch.int64)
        if params:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        with_grad = [p for p, flag in zip(params, flags.tolist()) if flag]
        for param in with_grad:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        buckets = self._buckets([p.grad for p in with_grad])  # type: ignore[misc]
        stream = self._comm_stream()
        done = None
        flats = []
        for grads in buckets:
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.replicas)
            ready = stream.ready_marker()  # the bucket's copy is written on the compute stream
            with stream.issuing(ready):
                stream.keep_alive(flat)
                dist.all_reduce(flat, group=self.group)
                done = stream.done_marker()
            flats.append(flat)
        stream.join(done)  # the compute stream waits once, for the last bucket's all-reduce
        for grads, flat in zip(buckets, flats):
            views = [part.view_as(g) for part, g in zip(flat.split([g.numel() for g in grads]), grads)]
            torch._foreach_copy_(grads, views)
        self.averaged_steps += 1
        self.finished = True

    # ------------------------------------------------------------------ overlapped with the backward
    @property
    def pending(self) -> bool:
        """Whether an armed step's average waits for :meth:`finish`."""
        return self._step is not None

    def reset(self) -> None:
        """At the start of a step: nothing of the previous one is left (an armed step whose optimizer step
        never came has its collectives waited for and dropped)."""
        step, self._step = self._step, None
        self.finished = False
        if step is None:
            return
        for handle in step.handles:
            handle.remove()
        for work in step.works:
            if work is not None:
                work.wait()
        self._comm_stream().join(step.done)

    def arm(self, params: Sequence[nn.Parameter], final_backward: int) -> None:
        """Before a step whose gradients become final in micro-batch ``final_backward``'s backward (0-based;
        :meth:`backward_done` counts them): a hook on each of ``params`` (this stage's trainable parameters,
        the same list in every replica) marks its gradient final in that backward, and the buckets start
        their all-reduce in a fixed order, a bucket once it and every bucket before it are complete, so every
        replica issues the same collectives in the same order whatever order its hooks fire in.

        The buckets take the parameters from the last to the first (backward's order), per dtype and
        device, at most ``bucket_bytes`` each. A parameter whose hook does not fire in that backward (no
        gradient there, a skipped micro-batch) holds its bucket and every later one until :meth:`flush`."""
        self.reset()
        key = tuple(id(p) for p in params)
        if key != self._layout_key:  # a rebalance moved layers: the buckets follow the stage's parameters
            self._layout_key, self._layout = key, self._param_buckets(params)
        step = self._step = _OverlappedStep(params, self._layout, final_backward)
        step.handles = [
            param.register_post_accumulate_grad_hook(self._hook(step, index))
            for index, param in enumerate(step.params)
        ]

    def _hook(self, step: _OverlappedStep, index: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            if step.backwards_done != step.final_backward:
                return
            if index in step.hooked:
                step.repeated = True
                return
            step.hooked.add(index)
            bucket = step.bucket_of[index]
            step.missing[bucket] -= 1
            if step.missing[bucket] == 0:
                self._launch_ready(step, from_hook=True)

        return hook

    def backward_done(self) -> None:
        """One micro-batch's backward of this stage ended (the schedule calls it after each)."""
        if self._step is not None:
            self._step.backwards_done += 1

    def flush(self) -> None:
        """After the step's last backward: the hooks go, and the buckets not started yet start, in order."""
        step = self._step
        if step is None:
            return
        for handle in step.handles:
            handle.remove()
        step.handles = []
        step.missing = [0] * len(step.buckets)
        self._launch_ready(step, from_hook=False)

    def disarm(self) -> None:
        """After a failed step: no hook stays on the parameters."""
        if self._step is not None:
            for handle in self._step.handles:
                handle.remove()
            self._step.handles = []

    @torch.no_grad()
    def _launch_ready(self, step: _OverlappedStep, from_hook: bool) -> None:
        # From a hook on CUDA this runs on autograd's device thread while the training thread waits in
        # backward (as DDP's reducer): the event orders the side stream after the gradients' kernels, and
        # no kernel of the backward waits for the all-reduce. A CPU run checks the order of these
        # collectives (the emulated NCCL) and their values (gloo), not the device's overlap (docs/gpu.md).
        stream = self._comm_stream()
        while step.next_bucket < len(step.buckets) and step.missing[step.next_bucket] == 0:
            members = [step.params[i] for i in step.buckets[step.next_bucket]]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in members]
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.replicas)
            with stream.issuing(stream.ready_marker()):  # after the gradients' kernels (compute stream)
                stream.keep_alive(flat)
                work = dist.all_reduce(flat, group=self.group, async_op=True)
                if stream.on_device:  # orders the side stream after the collective; the host goes on
                    work.wait()
                    work = None
                step.done = stream.done_marker()
            step.flats.append(flat)
            step.works.append(work)
            step.next_bucket += 1
            if from_hook:
                step.from_hooks += 1

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for the armed step's all-reduces (on CUDA: the compute stream waits, the host does not) and
        give every parameter the average, or ``None`` where no replica had a gradient (host flags, as in
        :meth:`average`)."""
        step = self._step
        if step is None:
            return
        self.flush()
        self._step = None
        for work in step.works:
            if work is not None:
                work.wait()
        self._comm_stream().join(step.done)
        params = step.params
        # host flags: which parameters have a gradient, and (last) whether a gradient accumulated again after
        # its bucket started (a parameter reached by two backward calls within the last micro-batch's, as a
        # reentrant checkpoint does): then every replica drops the started sums and averages after the
        # backward, from the gradients as they are now
        have = [int(p.grad is not None) for p in params]
        flags = torch.tensor([*have, int(step.repeated)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        *any_grad, repeated = flags.tolist()
        if repeated:
            self.repeated_steps += 1
            self.average(params)
            return
        targets: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for members, flat in zip(step.buckets, step.flats):
            parts = flat.split([params[i].numel() for i in members])
            for i, part in zip(members, parts):
                if not any_grad[i]:
                    continue  # zeros from every replica: the parameter keeps grad=None
                param = params[i]
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                targets.append(param.grad)
                values.append(part.view_as(param))
        if targets:
            torch._foreach_copy_(targets, values)
        self.averaged_steps += 1
        self.overlapped_steps += 1
        self.buckets_from_hooks += step.from_hooks
        self.finished = True

    def _param_buckets(self, params: Sequence[nn.Parameter]) -> list[list[int]]:
        """Indices into ``params`` in buckets (:meth:`_buckets` over the parameters, last to first)."""
        order = list(range(len(params)))[::-1]
        index_of = {id(params[i]): i for i in order}
        buckets = self._buckets([params[i] for i in order])
        return [[index_of[id(p)] for p in bucket] for bucket in buckets]

    def _buckets(self, grads: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        """``grads`` in buckets of one dtype and device, at most ``bucket_bytes`` each (a larger gradient
        alone), in the order given (the same in every replica)."""
        open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[torch.Tensor], int]] = {}
        buckets: list[list[torch.Tensor]] = []
        for grad in grads:
            key = (grad.dtype, grad.device)
            nbytes = grad.numel() * grad.element_size()
            bucket, size = open_buckets.get(key, ([], 0))
            if bucket and size + nbytes > self.bucket_bytes:
                buckets.append(bucket)
                bucket, size = [], 0
            bucket.append(grad)
            open_buckets[key] = (bucket, size + nbytes)
        buckets.extend(bucket for bucket, _ in open_buckets.values() if bucket)
        return buckets


def agree_with_replica_0(value: Any, layout: ReplicaLayout, stage: int, group: Any) -> Any:
    """Replica 0's ``value`` (a host object: a stage's memory plan) on every replica of ``stage``, so that
    every replica runs its stage alike (collective over the stage's replicas, on their CPU backend)."""
    box = [value]
    dist.broadcast_object_list(box, src=layout.rank(0, stage), group=group)
    return box[0]


def averaged_over_replicas(
    rows: torch.Tensor, group: Any, replicas: int, max_columns: int = 0
) -> torch.Tensor:
    """The mean of every replica's ``rows`` (host float64, the same shape in each; the last ``max_columns``
    columns take the largest value instead), the same on every rank: each computes it from the same gathered
    rows in the same order (collective over the stage's replicas)."""
    gathered = [torch.empty_like(rows) for _ in range(replicas)]
    dist.all_gather(gathered, rows.contiguous(), group=group)
    stacked = torch.stack(gathered)
    combined = stacked.mean(0)
    if max_columns:
        combined[..., -max_columns:] = stacked[..., -max_columns:].amax(0)
    return combined
