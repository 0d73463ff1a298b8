"""The parameter server, sharded over all ranks with ``hier_sliced``'s slicing and sharded optimizer.

The master copy of the model lives in flat buckets laid out exactly as ``hier_sliced`` lays out a
model (:mod:`lightning_hier.sliced.flat_buckets`); each rank owns slice ``local_rank`` of every bucket
and the user's optimizer state for that slice only
(:class:`~lightning_hier.sliced.piece_sharding.PieceSharding`: one optimizer parameter per model
parameter and slice, so a parameter no worker used keeps its state and step count).
One superstep: every worker's gradient sums are reduce-scattered inside the node (on gloo: all-reduced,
each rank keeping its slice) and all-reduced across nodes, then scaled by one over the job-wide
micro-step count (the job-wide mean gradient per micro-step, slice by slice; with
``gradient_average="nominal"`` one over ``superstep_steps x world_size``; in plain BSP the buckets of
the last micro-step may go while its backward still runs), clipped by the global norm when asked,
stepped by the user's optimizer on the owned slices, and all-gathered inside the node into the full
master model.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_hier.bucketing.size_plan import BucketPlan
from lightning_hier.single_rank import alone_in
from lightning_hier.sliced.compressed_hop import compresses, hop_bytes, start_compressed_all_reduce
from lightning_hier.sliced.flat_buckets import FlatBucket, build_flat_buckets
from lightning_hier.sliced.piece_sharding import PieceSharding
from lightning_hier.sliced.reducer import all_gather_slices, reduce_scatter_into
from lightning_hier.sliced.slicing import SlicePlan
from lightning_hier.topology import Topology, emulating_cuda


class ShardedParameterServer:
    """Master parameters and optimizer state, one slice per rank of a node (the server shards).

    ``params`` are the worker's parameters in plan order (their values seed the master copy; they are
    not touched); ``original_groups`` the optimizer's param groups as the user built them. The server
    steps a copy of ``optimizer`` (:func:`server_copy`).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        group_of: Sequence[int],
        optimizer: torch.optim.Optimizer,
        original_groups: Sequence[Sequence[nn.Parameter]],
        topology: Topology,
        plan: BucketPlan,
        slice_plan: SlicePlan,
        inter_node_dtype: torch.dtype | None = None,
    ) -> None:
        assert topology.intra_group is not None and topology.inter_group is not None
        self.topology = topology
        self.optimizer = server_copy(optimizer)
        optimizer = self.optimizer
        master = [nn.Parameter(p.detach().clone(), requires_grad=False) for p in params]
        self.buckets: list[FlatBucket] = build_flat_buckets(master, plan, slice_plan, topology.local_rank)
        for param in master:  # the flat buckets hold the values; per-parameter gradients are never used
            param.grad = None
        bucket_group = [group_of[bucket.slots[0].index] for bucket in self.buckets]
        for group, original in zip(optimizer.param_groups, original_groups):
            group["params"] = list(original)
        # per-parameter pieces: a parameter no worker used in a superstep keeps its state and step
        # count (the buckets cannot be rebuilt between supersteps, as hier_sliced's are between steps)
        self.sharding = PieceSharding(
            optimizer, self.buckets, bucket_group, original_groups, params, topology.intra_group
        )
        self._slice_grads = [bucket.grads[slice(*bucket.owned_range)] for bucket in self.buckets]
        # a CPU run's gloo group (not the device-rule audit's stand-in for NCCL, which must take NCCL's path)
        intra = topology.intra_group
        self._gloo_intra = (
            dist.get_world_size(intra) > 1 and dist.get_backend(intra) == "gloo" and not emulating_cuda()
        )
        for shard, grad in zip(self.sharding.shards, self._slice_grads):
            shard.grad = grad
        # the push across nodes in ``inter_node_dtype``, each slice with its own error feedback (what
        # rounding dropped from this rank's slice, added to the next superstep's node sum)
        compressing = not alone_in(topology.inter_group) and any(
            compresses(inter_node_dtype, grad.dtype) for grad in self._slice_grads
        )
        self.inter_node_dtype = inter_node_dtype if compressing else None
        self._residuals = [torch.zeros_like(grad) if compressing else None for grad in self._slice_grads]

    def flat_params(self) -> list[torch.Tensor]:
        """The full master model, one flat tensor per bucket (valid after :meth:`apply`)."""
        return [bucket.params for bucket in self.buckets]

    @torch.no_grad()
    def push(self, sums: Sequence[torch.Tensor], buckets: Sequence[int] | None = None) -> int:
        """Reduce every rank's ``sums`` of ``buckets`` (default all, in this order on every rank) into
        this rank's gradient slices; returns the bytes this rank sent (a ring's ``(n-1)/n`` of what it
        reduces, per group). :meth:`scale` then makes them means."""
        intra, inter = self.topology.intra_group, self.topology.inter_group
        intra_size, inter_size = dist.get_world_size(intra), dist.get_world_size(inter)
        sent = 0
        for b in range(len(self.buckets)) if buckets is None else buckets:
            bucket, total, grad = self.buckets[b], sums[b], self._slice_grads[b]
            if self._gloo_intra:
                # gloo's reduce-scatter is slower than its all-reduce of the whole bucket (4 ranks,
                # 4.5 MB: 10.0 ms against 7.3 ms on a 2-core CPU), so sum everything and keep the
                # slice; the sums are the aggregate's read-out buffer, zeroed after the push anyway
                dist.all_reduce(total, group=intra)
                grad.copy_(total[slice(*bucket.owned_range)])
            else:
                reduce_scatter_into(grad, total, bucket.bounds, intra)
            if not alone_in(inter):
                self._all_reduce_across_nodes(grad, self._residuals[b])
            sent += hop_bytes(total.numel(), total.element_size(), None, intra_size)
            sent += hop_bytes(grad.numel(), grad.element_size(), self.inter_node_dtype, inter_size)
        return sent

    def _all_reduce_across_nodes(self, grad: torch.Tensor, residual: torch.Tensor | None) -> None:
        inter = self.topology.inter_group
        if not compresses(self.inter_node_dtype, grad.dtype):
            dist.all_reduce(grad, group=inter)
            return
        work, finish = start_compressed_all_reduce(grad, residual, self.inter_node_dtype, inter)
        work.wait()  # on a GPU the current stream waits, not the host
        finish()

    @torch.no_grad()
    def scale(self, factor: float) -> None:
        """Multiply the reduced gradient slices by ``factor`` (one over ``BSPSettings.gradient_divisor``:
        the superstep's micro-steps, or ``superstep_steps x world_size`` with ``"nominal"``)."""
        for grad in self._slice_grads:
            grad.mul_(factor)

    @torch.no_grad()
    def step(
        self,
        clip: tuple[str, float] | None = None,
        hyper: list[dict] | None = None,
        unused: Sequence[int] = (),
    ) -> None:
        """Clip (``("norm", max_norm)`` by the global norm, ``("value", v)`` elementwise), then the user's
        optimizer on this rank's slices, with ``hyper`` (per param group: lr, ...) when given. Parameters
        ``unused`` (indices) by every worker in the superstep get no gradient, so the optimizer leaves
        them, their state and their step count as they were, as ``ddp`` does."""
        for shard, grad in zip(self.sharding.shards, self._slice_grads):
            shard.grad = grad
        if hyper is not None:
            for group, settings in zip(self.optimizer.param_groups, hyper):
                group.update(settings)
        if clip is not None:
            algorithm, value = clip
            if algorithm == "norm":
                self.sharding.clip_grad_norm_(value)
            else:
                for grad in self._slice_grads:
                    grad.clamp_(-value, value)
        self.sharding.give_gradients(self._slice_grads, unused)
        self.optimizer.step()

    @torch.no_grad()
    def pull(self) -> int:
        """All-gather the updated slices inside the node; returns the bytes this rank sent."""
        works = []
        intra = self.topology.intra_group
        for bucket in self.buckets:
            works.extend(all_gather_slices(bucket.params, bucket.bounds, intra))
        for work in works:
            work.wait()
        size = dist.get_world_size(intra)
        return sum(hop_bytes(b.params.numel(), b.params.element_size(), None, size) for b in self.buckets)


def server_copy(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The user's optimizer as the server runs it: the same class, settings and hooks, with param groups
    and state of its own.

    The user's object stays with the training loop, where LR schedulers and monitors read and write its
    ``param_groups`` between steps; the server thread steps its copy with the settings each superstep
    was computed with, so neither side overwrites the other's values mid-step.
    """
    # not copy.copy: Optimizer.__getstate__ keeps only defaults, state and param_groups, so the copy
    # lost the step hooks, the user's own attributes, and torch's _warned_capturable_if_run_uncaptured
    # (without it Adafactor's step on CUDA reads a "capturable" setting it does not have: KeyError)
    copied = object.__new__(type(optimizer))
    copied.__dict__.update(optimizer.__dict__)
    copied.__dict__.pop("step", None)  # an LR scheduler's wrapper calls the original's step
    copied.param_groups = [dict(group) for group in optimizer.param_groups]
    # a state of its own, starting as the user's (some optimizers make it in the constructor)
    copied.state = defaultdict(dict, optimizer.state)
    return copied

