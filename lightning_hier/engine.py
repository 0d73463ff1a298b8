"""One hier_sliced training step in plain torch, independent of Lightning.

:class:`HierSlicedEngine` takes a module, its optimizer and a built :class:`Topology`, and then:

1. lays the optimizer's trainable parameters into flat buckets (:mod:`lightning_hier.flat_buckets`);
2. hooks every parameter so that, on a synchronising backward, each bucket is handed to the
   :class:`~lightning_hier.comm.hierarchical.HierarchicalReducer` the moment its last gradient
   is ready (buckets in plan order), overlapping communication with the rest of backward;
3. :meth:`finish_backward` waits for the reductions and gives the optimizer's slices their
   averaged gradients;
4. the optimizer (rewired by :class:`~lightning_hier.sharded_optim.OptimizerSharding`) steps
   this rank's slices; :meth:`after_step` all-gathers the updated slices inside the node.

Usage without Lightning::

    engine = HierSlicedEngine(model, optimizer, topology.build_groups())
    loss.backward(); engine.finish_backward()
    optimizer.step(); engine.after_step()
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_hier.comm.buckets import BucketPlan, ParamInfo, plan_size_buckets
from lightning_hier.comm.hierarchical import HierarchicalReducer, ReduceJob, all_gather_slices
from lightning_hier.comm.slicing import SlicePlan
from lightning_hier.flat_buckets import FlatBucket, build_flat_buckets
from lightning_hier.sharded_optim import OptimizerSharding, check_optimizer
from lightning_hier.topology import Topology


class HierSlicedEngine:
    """Hierarchical sliced gradient reduction with an in-node sharded optimizer."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        topology: Topology,
        slice_plan: SlicePlan | None = None,
        bucket_cap_mb: float = 25.0,
        bucket_plan: BucketPlan | None = None,
    ) -> None:
        if topology.intra_group is None or topology.inter_group is None:
            raise ValueError(
                "HierSlicedEngine needs a topology whose groups are built (Topology.build_groups())."
            )
        check_optimizer(optimizer)
        self.module = module
        self.optimizer = optimizer
        self.topology = topology
        self.world_size = topology.world_size
        self.slice_plan = slice_plan or SlicePlan((1.0,) * topology.devices_per_node)
        if self.slice_plan.num_slices != topology.devices_per_node:
            raise ValueError(
                f"the slice plan has {self.slice_plan.num_slices} slices but a node has "
                f"{topology.devices_per_node} devices."
            )
        original_groups = [list(group["params"]) for group in optimizer.param_groups]
        self.params, group_of = _trainable_params(original_groups)
        if not self.params:
            raise ValueError("the optimizer holds no trainable parameters (all have requires_grad=False).")
        self.param_names = _names_of(module, self.params)
        infos = [
            ParamInfo(i, p.numel(), p.element_size(), (group_of[i], p.dtype, p.device))
            for i, p in enumerate(self.params)
        ]
        self.bucket_plan = bucket_plan or plan_size_buckets(infos, int(bucket_cap_mb * 1024 * 1024))
        self.buckets: list[FlatBucket] = build_flat_buckets(
            self.params, self.bucket_plan, self.slice_plan, topology.local_rank
        )
        bucket_group = [group_of[bucket.slots[0].index] for bucket in self.buckets]
        self.sharding = OptimizerSharding(
            optimizer, self.buckets, bucket_group, original_groups, self.params, topology.intra_group
        )
        self._bucket_of = self.bucket_plan.bucket_of()
        self._reducer = HierarchicalReducer(topology.intra_group, topology.inter_group)
        self._slice_grads = [self._slice_grad_buffer(bucket) for bucket in self.buckets]
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._used = torch.zeros(len(self.params), dtype=torch.int32)
        self._jobs: list[ReduceJob | None] = [None] * len(self.buckets)
        self._next_to_launch = 0
        self._sync = True
        self._unused_snapshot: list[tuple[int, int, int, dict[str, torch.Tensor]]] = []
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)
        ]

    # ------------------------------------------------------------------ setup helpers
    def _slice_grad_buffer(self, bucket: FlatBucket) -> torch.Tensor:
        start, end = bucket.owned_range
        if self.topology.devices_per_node == 1:
            return bucket.grads[start:end]  # no scatter: reduce the bucket in place
        return torch.zeros(end - start, dtype=bucket.dtype, device=bucket.device)

    def sync_module_states(self, src: int = 0) -> None:
        """Copy parameters and buffers from global rank ``src`` to every rank (as DDP does at start)."""
        if self.world_size == 1:
            return
        for bucket in self.buckets:
            dist.broadcast(bucket.params, src=src)
        self.broadcast_buffers(src)

    def broadcast_buffers(self, src: int = 0) -> None:
        if self.world_size == 1:
            return
        for buffer in self.module.buffers():
            dist.broadcast(buffer.data, src=src)

    # ------------------------------------------------------------------ backward
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; nothing is communicated inside this context."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _make_hook(self, index: int):  # noqa: ANN202 - autograd hook signature
        bucket_index = self._bucket_of[index]
        bucket = self.buckets[bucket_index]
        slot = next(s for s in bucket.slots if s.index == index)

        def hook(param: torch.Tensor) -> None:
            view = bucket.grad_view(slot)
            if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                # somebody replaced or reset .grad (e.g. module.zero_grad(set_to_none=True))
                if param.grad is not None:
                    view.copy_(param.grad)
                param.grad = view
            self._used[index] = 1
            if not self._sync:
                return
            ready = self._ready[bucket_index]
            ready.add(index)
            if len(ready) == len(bucket.slots):
                self._launch_ready_buckets()

        return hook

    def _launch_ready_buckets(self) -> None:
        while self._next_to_launch < len(self.buckets):
            b = self._next_to_launch
            if len(self._ready[b]) < len(self.buckets[b].slots):
                return
            self._launch(b)

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        self._jobs[b] = self._reducer.submit(ReduceJob(bucket.grads, bucket.bounds, self._slice_grads[b]))
        self._next_to_launch = b + 1

    def finish_backward(self) -> None:
        """End of a synchronising backward: flush the remaining buckets and wait for all of them.

        Buckets holding parameters that produced no gradient on this rank are sent with zeros for
        those parameters, in plan order on every rank, so no rank waits for a bucket that never fills.
        Parameters that no rank used are left untouched by the step, as under DDP.
        """
        if not self._sync:
            return
        self._record_globally_unused()
        while self._next_to_launch < len(self.buckets):
            self._launch(self._next_to_launch)
        for b, job in enumerate(self._jobs):
            assert job is not None
            self._reducer.wait(job)
            grad = self._slice_grads[b]
            if self.world_size > 1:
                grad.div_(self.world_size)
            self.sharding.shards[b].grad = grad
        self._reset_backward_state()

    def _reset_backward_state(self) -> None:
        for ready in self._ready:
            ready.clear()
        self._jobs = [None] * len(self.buckets)
        self._next_to_launch = 0
        self._used.zero_()

    def _record_globally_unused(self) -> None:
        """Remember parameters no rank used, so the step leaves them (and their state) untouched.

        DDP leaves such parameters' ``.grad`` as ``None`` and optimizers skip them; a flat slice
        cannot skip part of itself, so we snapshot those elements and restore them after the step.
        """
        used = self._used.clone()
        if self.world_size > 1:  # one tiny all-reduce per step; no flag to get wrong, unlike DDP
            dist.all_reduce(used, op=dist.ReduceOp.MAX)
        self._unused_snapshot = []
        for index in torch.nonzero(used == 0).flatten().tolist():
            bucket = self.buckets[self._bucket_of[index]]
            shard = self.sharding.shards[bucket.index]
            start, end = bucket.owned_range
            slot = next(s for s in bucket.slots if s.index == index)
            lo, hi = max(start, slot.offset) - start, min(end, slot.offset + slot.numel) - start
            if lo >= hi:
                continue
            saved = {"__param__": shard.detach()[lo:hi].clone()}
            for key, value in self.optimizer.state.get(shard, {}).items():
                if torch.is_tensor(value) and value.shape == shard.shape:
                    saved[key] = value[lo:hi].clone()
            self._unused_snapshot.append((bucket.index, lo, hi, saved))

    # ------------------------------------------------------------------ step
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return self.sharding.clip_grad_norm_(max_norm, norm_type)

    @torch.no_grad()
    def after_step(self) -> None:
        """Restore untouched parameters, all-gather updated slices in the node, clear gradients."""
        for b, lo, hi, saved in self._unused_snapshot:
            shard = self.sharding.shards[b]
            shard.data[lo:hi].copy_(saved["__param__"])
            for key, value in self.optimizer.state.get(shard, {}).items():
                if key in saved:
                    value[lo:hi].copy_(saved[key])
                elif torch.is_tensor(value) and value.shape == shard.shape:
                    value[lo:hi].zero_()  # state first made by this step: as fresh as DDP's would be
        self._unused_snapshot = []
        works = []
        for bucket in self.buckets:
            works.extend(all_gather_slices(bucket.params, bucket.bounds, self.topology.intra_group))
        for work in works:
            work.wait()
        self.zero_grad()

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.grads.zero_()

    # ------------------------------------------------------------------ checkpoints and teardown
    def optimizer_state_dict(self) -> dict[str, Any]:
        return self.sharding.consolidated_state_dict()

    def load_optimizer_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sharding.load_consolidated_state_dict(state_dict)

    def close(self) -> None:
        """Remove the hooks and stop the communication thread (parameters stay as they are)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._reducer.close()


def _trainable_params(groups: Sequence[Sequence[nn.Parameter]]) -> tuple[list[nn.Parameter], list[int]]:
    """Trainable parameters of the optimizer, each once, with the index of its param group."""
    params: list[nn.Parameter] = []
    group_of: list[int] = []
    seen: set[int] = set()
    for group_index, group in enumerate(groups):
        for param in group:
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
                group_of.append(group_index)
    return params, group_of


def _names_of(module: nn.Module, params: Sequence[nn.Parameter]) -> list[str]:
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=True)}
    return [names.get(id(p), f"<param {i}>") for i, p in enumerate(params)]
