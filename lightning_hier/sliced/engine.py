"""One hier_sliced training step in plain torch, independent of Lightning.

:class:`HierSlicedEngine` takes a module, its optimizer and a built :class:`Topology`, and then:

1. lays the optimizer's trainable parameters into flat buckets (:mod:`lightning_hier.sliced.flat_buckets`);
2. hooks every parameter so that, on a synchronising backward, each bucket is handed to the
   :class:`~lightning_hier.sliced.reducer.HierarchicalReducer` the moment its last gradient
   is ready (buckets in plan order), overlapping communication with the rest of backward (on
   CUDA issued from the hooks with stream waits, on gloo from a communication thread);
3. :meth:`finish_backward` waits for the reductions and gives the optimizer's slices their
   averaged gradients;
4. the optimizer (rewired by :class:`~lightning_hier.sliced.sharded_optim.OptimizerSharding`) steps
   this rank's slices; :meth:`after_step` all-gathers the updated slices inside the node.

Usage without Lightning::

    engine = HierSlicedEngine(model, optimizer, topology.build_groups())
    loss.backward(); engine.finish_backward()
    optimizer.step(); engine.after_step()
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from lightning_hier.bucketing.size_plan import BucketPlan, ParamInfo, plan_size_buckets
from lightning_hier.bucketing.step_clock import EventFactory, StepClock
from lightning_hier.bucketing.time_bucketing import (
    StepTimeline,
    TimeBucketing,
    TimeBucketingConfig,
    validate_time_settings,
)
from lightning_hier.bucketing.time_plan import TimePlan, plan_misfit
from lightning_hier.single_rank import alone
from lightning_hier.sliced.flat_buckets import FlatBucket, adopt_gradient, build_flat_buckets, slot_locations
from lightning_hier.sliced.reducer import ReduceJob, all_gather_slices, chunk_bytes_for, make_reducer
from lightning_hier.sliced.replicated_optim import ReplicatedOptimizer
from lightning_hier.sliced.sharded_optim import (
    OptimizerSharding,
    check_no_new_parameters,
    decide_sharding,
    frozen_parameters,
    refuse_shared_parameters,
    update_rule_of,
)
from lightning_hier.sliced.slicing import SlicePlan
from lightning_hier.sliced.unused import UnusedSnapshot, snapshot_unused
from lightning_hier.topology import Topology

log = logging.getLogger(__name__)

_BACKWARD_END = "backward_end"
# the user's optimizer's attribute naming the engine that holds it (its slices, or it whole), until given back
_HELD_BY = "_hier_sliced_engine"


class HierSlicedEngine:
    """Hierarchical sliced gradient reduction with an in-node sharded optimizer.

    ``bucketing`` chooses what is sent together and when: ``"size"`` (size-capped buckets in
    reverse registration order, each sent when its last gradient is ready), ``"time"`` (profiled
    gradient-ready times clustered into time points, see :mod:`lightning_hier.bucketing.time_bucketing`)
    or ``"none"`` (all buckets sent after backward, no overlap).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        topology: Topology,
        slice_plan: SlicePlan | None = None,
        bucket_cap_mb: float = 25.0,
        bucket_plan: BucketPlan | None = None,
        bucketing: str = "size",
        time_config: TimeBucketingConfig | None = None,
        comm_chunk_mb: float | None = None,
        reducer: str = "auto",
        event_factory: EventFactory | None = None,
        elementwise_optimizers: Sequence[str] = (),
        inter_node_dtype: torch.dtype | None = None,
        shard_optimizer: bool | None = None,
    ) -> None:
        if topology.intra_group is None or topology.inter_group is None or topology.world_group is None:
            raise ValueError("HierSlicedEngine needs a topology with built groups (Topology.build_groups()).")
        validate_time_settings(bucketing, 1, 0, 0.5)
        give_back_left_held(optimizer)  # before its param groups are read
        # False: the optimizer stays whole on every rank (replicated_optim.py), for non-elementwise updates
        self.replicated = not decide_sharding(optimizer, elementwise_optimizers, shard_optimizer)
        self.module = module
        self.optimizer = optimizer
        self.topology = topology
        self.world_size = topology.world_size
        self.bucketing = bucketing
        self.slice_plan = slice_plan or SlicePlan((1.0,) * topology.devices_per_node)
        if self.slice_plan.num_slices != topology.devices_per_node:
            raise ValueError(
                f"the slice plan has {self.slice_plan.num_slices} slices but a node has "
                f"{topology.devices_per_node} devices."
            )
        self._original_groups = [list(group["params"]) for group in optimizer.param_groups]
        # per parameter (by id): the take-in that brought it (0: setup, see take_in_new_parameters); its
        # buckets never mix with other cohorts', whose optimizer state (momenta, step counts) is older
        self._cohort: dict[int, int] = {}
        self._take_ins = 0
        self._take_params()
        self.cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        self.device = next(p for group in self._original_groups for p in group).device
        self.clock = StepClock(self.device, event_factory)
        self._time_config = time_config
        self.time_bucketing: TimeBucketing | None = None
        if bucketing == "time":
            self.time_bucketing = self._new_time_bucketing()
        self._reducer = make_reducer(
            topology.intra_group,
            topology.inter_group,
            chunk_bytes_for(comm_chunk_mb, self.device),
            self.device,
            reducer,
            inter_node_dtype,
        )
        self.inter_node_dtype = inter_node_dtype
        self._layout_generation = -1  # which bucket layout a step ran on (its timeline is keyed by it)
        # host control data (the device rule): which parameters produced a gradient on this rank (a
        # bytearray: the hooks set it once per parameter per backward, where a tensor store costs ~4 us)
        self._used = bytearray(len(self.params))
        # each parameter's gradient-ready time: what time bucketing plans from and what
        # GradientTimingProfiler draws; otherwise not taken (on a GPU each is a CUDA event recorded per
        # parameter per step)
        self.record_ready_times = bucketing == "time"
        self._every_parameter = frozenset(range(len(self.params)))
        self._globally_used: frozenset[int] = self._every_parameter
        self._used_steps = [0] * len(self.params)  # synchronised steps in which each parameter was used
        self._isolated: set[int] = set()  # parameters given a bucket of their own (see _note_partly_used)
        self._to_isolate: set[int] = set()
        # SGD's update depends on nothing but each element's gradient and momentum; the others keep a
        # per-tensor step count (bias correction, lr decay) that a shared slice cannot keep per parameter
        self._step_counted = update_rule_of(optimizer) != "SGD"
        self._sync = True
        self._overlap = True
        self._unused_snapshot = UnusedSnapshot()
        self._end_callback_queued = False
        self._backward_open = False  # between begin_backward and finish_backward
        # set by the strategy: called when a gradient arrives outside begin/finish_backward (a raw
        # ``loss.backward()`` under manual optimization); it opens this backward and returns what ends
        # it, or returns None for a backward that only accumulates locally. None here: every backward
        # is a synchronising one (the engine used on its own, ``loss.backward(); finish_backward()``).
        self.open_unannounced_backward: Callable[[], Callable[[], None] | None] | None = None
        self.last_timeline: StepTimeline | None = None
        self.sharding: OptimizerSharding | ReplicatedOptimizer | None = None
        self.optimizer_given_back = False  # give_back_optimizer ran: the optimizer is the user's again
        self._showing_user_groups = False  # inside user_param_groups
        self._layout(bucket_plan or plan_size_buckets(self.param_infos, self.cap_bytes))
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)
        ]
        if not self.replicated:
            self._route_state_dict()
        optimizer.__dict__[_HELD_BY] = self

    def _take_params(self) -> None:
        """The trainable parameters of ``_original_groups`` (the optimizer's groups as the user built them,
        in order), their names, the module's frozen ones and what the planners need of each."""
        self.params, self._group_of = trainable_params(self._original_groups)
        if not any(self._original_groups):
            raise ValueError("the optimizer holds no parameters.")
        # all frozen is allowed: a fine-tuning callback may unfreeze them before the first step (taken in)
        self.param_names = _names_of(self.module, self.params)
        self._frozen_at_setup = frozen_parameters(self.module)
        trainable = {id(p) for p in self.params}
        # in the optimizer's groups but frozen: taken in once trainable (has_new_parameters)
        self._frozen_in_groups = [
            p for group in self._original_groups for p in group if id(p) not in trainable
        ]
        self.param_infos = [
            ParamInfo(
                i,
                p.numel(),
                p.element_size(),
                (self._group_of[i], p.dtype, p.device, self._cohort.get(id(p), 0)),
            )
            for i, p in enumerate(self.params)
        ]

    def _new_time_bucketing(self) -> TimeBucketing:
        return TimeBucketing(
            self.param_infos,
            self.cap_bytes,
            self._time_config,
            self.topology.world_group,
            resolves_late=self.clock.uses_events,
        )

    # ------------------------------------------------------------------ layout
    def _layout(self, plan: BucketPlan, optimizer_state: dict[str, Any] | None = None) -> None:
        """Lay parameters into flat buckets following ``plan`` and shard the optimizer over them."""
        self.bucket_plan = plan
        self._layout_generation += 1
        self.buckets: list[FlatBucket] = build_flat_buckets(
            self.params, plan, self.slice_plan, self.topology.local_rank
        )
        bucket_group = [self._group_of[bucket.slots[0].index] for bucket in self.buckets]
        for group, original in zip(self.optimizer.param_groups, self._original_groups):
            group["params"] = original
        self.sharding = (
            ReplicatedOptimizer(self.optimizer, self.buckets)
            if self.replicated
            else OptimizerSharding(
                self.optimizer,
                self.buckets,
                bucket_group,
                self._original_groups,
                self.params,
                self.topology.intra_group,
            )
        )
        if optimizer_state is not None:
            self.sharding.load_consolidated_state_dict(optimizer_state)
        self._where = slot_locations(self.buckets)
        # per parameter: its bucket and its .grad view there (the hook of every parameter reads them in
        # every backward; a lookup through _where and the bucket costs more)
        self._bucket_of = [self._where[i][0] for i in range(len(self.params))]
        self._param_pointers = [param.data_ptr() for param in self.params]  # where the layout put them
        self._grad_views = [
            self.buckets[b].grad_view(slot) for b, slot in (self._where[i] for i in range(len(self.params)))
        ]
        self._slice_grads = [self._slice_grad_buffer(bucket) for bucket in self.buckets]
        # error feedback of inter_node_dtype: each rank's rounding residual of its own slices (a new
        # layout starts from zero residuals)
        compressing = self.inter_node_dtype is not None and self.topology.num_nodes > 1
        self._residuals = [torch.zeros_like(g) if compressing else None for g in self._slice_grads]
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._jobs: list[ReduceJob | None] = [None] * len(self.buckets)
        self._next_to_launch = 0

    @torch.no_grad()
    def rebuild(self, plan: BucketPlan) -> None:
        """Switch to another bucket plan between steps, keeping parameters and optimizer state.

        A collective over the node: the optimizer state is consolidated (transiently the full
        state on every rank of the node), the parameters are laid out again and each rank takes
        its new slices.
        """
        if plan == self.bucket_plan:
            return
        state = self.sharding.consolidated_state_dict()
        for param in self.params:
            param.data = param.data.clone()
            param.grad = None
        self._layout(plan, state)

    # ------------------------------------------------------------------ parameters gained during fit
    def has_new_parameters(self) -> bool:
        """Whether the optimizer gained parameters since the buckets were laid out: a param group added
        (``add_param_group``), or a parameter of its groups that was frozen then and is trainable now.
        Reads host flags only, so it may run every step."""
        if self.optimizer_given_back:
            return False
        if len(self.optimizer.param_groups) != len(self._original_groups):
            return True
        return any(param.requires_grad for param in self._frozen_in_groups)

    @contextmanager
    def user_param_groups(self, take_in: bool = True) -> Iterator[None]:
        """Inside, the optimizer's param groups hold the module's parameters as the user built them, not this
        rank's flat slices, for code that finds or adds parameters there (Lightning's ``BaseFinetuning``
        names each one and adds groups). On leaving, the slices go back, and with ``take_in`` parameters the
        groups gained are taken in (:meth:`take_in_new_parameters`); after an exception inside, only the
        slices go back."""
        opened = not (self.optimizer_given_back or self.replicated or self._showing_user_groups)
        if opened:  # (a replicated optimizer holds the module's parameters anyway)
            for group, original in zip(self.optimizer.param_groups, self._original_groups):
                group["params"] = list(original)
            self._showing_user_groups = True
        try:
            yield
        finally:
            if opened:
                self._showing_user_groups = False
                assert isinstance(self.sharding, OptimizerSharding)
                for index, (group, original) in enumerate(
                    zip(self.optimizer.param_groups, self._original_groups)
                ):
                    if _same_parameters(group["params"], original):
                        group["params"] = self.sharding._optimizer_params(index)
        if take_in and not self._showing_user_groups:
            self.take_in_new_parameters()

    @torch.no_grad()
    def take_in_new_parameters(self) -> bool:
        """Lay the buckets and the optimizer's shards out again over its parameters as they are now, if it
        gained some (:meth:`has_new_parameters`); returns whether it did. Call it between steps.

        A parameter group added with ``add_param_group`` keeps its own settings (``lr``, ...); the
        optimizer state of the other parameters is kept (consolidated and cut again: a collective over
        the node when the optimizer is sharded, so every rank calls it at the same step boundary, with the
        same change). Newly trained parameters get buckets of their own, so they start with fresh state
        (their first momentum, step count 1) as under ``ddp``, and their gradients are averaged over every
        rank from their first step on. Time bucketing profiles the new layout again."""
        if not self.has_new_parameters():
            return False
        self._relayout_over(self._user_groups())
        return True

    def _user_groups(self) -> list[list[nn.Parameter]]:
        """The optimizer's param groups as module parameters: a known group that holds this rank's slices
        as the user built it; any other (added, or replaced while :meth:`user_param_groups` showed them) as
        it holds them."""
        slices = {id(shard) for shard in self.sharding.shards} if self.sharding is not None else set()
        groups = []
        for index, group in enumerate(self.optimizer.param_groups):
            params = list(group["params"])
            if index < len(self._original_groups) and all(id(p) in slices for p in params):
                params = list(self._original_groups[index])
            groups.append(params)
        return groups

    def _relayout_over(self, groups: list[list[nn.Parameter]]) -> None:
        """:meth:`take_in_new_parameters` onto ``groups`` (every param group's module parameters now)."""
        old_params = self.params
        # gradients accumulated locally so far (a step that does not clear them adds them to the next)
        grads = {id(p): p.grad.detach().clone() for p in old_params if p.grad is not None}
        used_steps = {id(p): steps for p, steps in zip(old_params, self._used_steps)}
        isolated = {id(old_params[i]) for i in self._isolated}
        assert self.sharding is not None
        self.sharding.unshard_into(groups)  # the optimizer's own parameters and full state
        # out of the old buckets, which go with them; on CUDA the side stream's last use of them was recorded
        # (DeviceStream.keep_alive: record_stream), so their memory is not reused before that use is done: a
        # CPU run cannot show it (docs/gpu.md)
        for param in old_params:
            param.data = param.data.clone()
            param.grad = None
        self._take_ins += 1
        trained_before = {id(p) for p in old_params}
        for param in trainable_params(groups)[0]:
            if id(param) not in trained_before:
                self._cohort[id(param)] = self._take_ins
        self._original_groups = [list(group) for group in groups]
        for handle in self._hooks:
            handle.remove()
        self._take_params()
        count = len(self.params)
        self._used = bytearray(count)
        self._every_parameter = frozenset(range(count))
        self._globally_used = self._every_parameter
        self._used_steps = [used_steps.get(id(p), 0) for p in self.params]
        self._isolated = {i for i, p in enumerate(self.params) if id(p) in isolated}
        self._to_isolate = set()
        self._unused_snapshot = UnusedSnapshot()
        if self.time_bucketing is not None:
            self.time_bucketing = self._new_time_bucketing()
        self._layout(self._with_isolated(plan_size_buckets(self.param_infos, self.cap_bytes)))
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)
        ]
        self._reset_backward_state()
        for index, param in enumerate(self.params):
            grad = grads.get(id(param))
            if grad is not None:
                self._grad_views[index].copy_(grad)
        new = [self.param_names[i] for i, p in enumerate(self.params) if id(p) not in trained_before]
        log.info(
            "hier_sliced: took in %d parameter(s) trainable since the last layout (%s); %d bucket(s) now",
            len(new),
            ", ".join(new[:4]) + (", ..." if len(new) > 4 else ""),
            len(self.buckets),
        )

    def checkpoint_state(self) -> dict[str, Any] | None:
        """What a checkpoint must hold to resume with this run's time plan (``None``: nothing to keep)."""
        if self.time_bucketing is None:
            return None
        plan = self.time_bucketing.plan
        return {"time_plan": plan.to_dict() if plan is not None else None}

    def load_checkpoint_state(self, state: dict[str, Any] | None) -> None:
        """Resume with the time plan :meth:`checkpoint_state` saved (same buckets, no new profiling)."""
        saved = (state or {}).get("time_plan")
        if saved is not None and self.time_bucketing is not None:
            self.restore_time_plan(TimePlan.from_dict(saved))

    def restore_time_plan(self, plan: TimePlan) -> bool:
        """Resume with a saved time plan (no new profiling) if it fits this model; else profile again."""
        if self.time_bucketing is None:
            return False
        reason = plan_misfit(plan, self.param_infos)
        if reason is not None:
            log.warning("the checkpoint's time plan does not fit this model (%s); profiling again", reason)
            return False
        self.time_bucketing.restore(plan)
        self.rebuild(self._with_isolated(plan.plan))
        return True

    def _slice_grad_buffer(self, bucket: FlatBucket) -> torch.Tensor:
        start, end = bucket.owned_range
        if self.topology.devices_per_node == 1:
            return bucket.grads[start:end]  # no scatter: reduce the bucket in place
        return torch.zeros(end - start, dtype=bucket.dtype, device=bucket.device)

    def sync_module_states(self, src: int = 0) -> None:
        """Copy parameters and buffers from global rank ``src`` to every rank (as DDP does at start).

        Frozen parameters and parameters outside the optimizer are copied too: every rank must run
        the same model, whatever each rank's initialisation drew.
        """
        if alone(self.world_size):
            return
        for bucket in self.buckets:
            dist.broadcast(bucket.params, src=src, group=self.topology.world_group)
        in_buckets = {id(p) for p in self.params}
        with torch.no_grad():
            for param in self.module.parameters():
                if id(param) not in in_buckets:
                    dist.broadcast(param.data, src=src, group=self.topology.world_group)
        self.broadcast_buffers(src)

    def broadcast_buffers(self, src: int = 0) -> None:
        if alone(self.world_size):
            return
        for buffer in self.module.buffers():
            dist.broadcast(buffer.data, src=src, group=self.topology.world_group)

    # ------------------------------------------------------------------ backward
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; nothing is communicated inside this context."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @property
    def syncing(self) -> bool:
        """False inside :meth:`no_sync` (an accumulating micro-batch)."""
        return self._sync

    def begin_backward(self, overlap: bool = True) -> None:
        """Mark the start of backward (the clock the ready times are measured on). With
        ``overlap=False`` this backward sends every bucket at :meth:`finish_backward` instead of as it
        fills (the strategy asks for it when several engines' gradients come from one backward: each
        engine's reducer thread would otherwise issue collectives on the same groups concurrently)."""
        self.clock.start()
        self._overlap = overlap
        self._backward_open = True

    def _on_backward_end(self) -> None:
        if self._end_callback_queued:  # else finish_backward already ran (an unannounced backward's end)
            self.clock.mark(_BACKWARD_END)

    def _open_unannounced(self) -> bool:
        """A gradient arrived with no backward open: the strategy decides (``open_unannounced_backward``)."""
        if self.open_unannounced_backward is None:
            return True
        finish = self.open_unannounced_backward()
        if finish is None:
            return False
        # runs when autograd finishes this backward, as DDP's reducer finalises its own
        Variable._execution_engine.queue_callback(finish)
        return True

    def _make_hook(self, index: int):  # noqa: ANN202 - autograd hook signature
        def hook(param: torch.Tensor) -> None:
            if not self._backward_open and not self._open_unannounced():
                adopt_gradient(param, self._grad_views[index])  # local accumulation only
                return
            if self.record_ready_times:
                self.clock.mark(("ready", index))
            if not self._end_callback_queued:
                self._end_callback_queued = True
                Variable._execution_engine.queue_callback(self._on_backward_end)
            bucket_index = self._bucket_of[index]
            # somebody replaced or reset .grad (e.g. module.zero_grad(set_to_none=True)), or it is sparse
            adopt_gradient(param, self._grad_views[index])
            self._used[index] = 1
            if not self._sync:
                return
            ready = self._ready[bucket_index]
            if index in ready and bucket_index < self._next_to_launch:
                raise RuntimeError(
                    f"parameter {self.param_names[index]!r} received a gradient twice in one backward "
                    "(reentrant activation checkpointing, or autograd.grad/backward on the same graph part "
                    "again), after its bucket was already sent: the second part would be lost. Use "
                    "torch.utils.checkpoint.checkpoint(..., use_reentrant=False), or "
                    "HierSlicedStrategy(bucketing='none'), which sends after backward."
                )
            ready.add(index)
            if (
                self.bucketing != "none"
                and self._overlap
                and len(ready) == len(self.buckets[bucket_index].slots)
            ):
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
        self.clock.mark(("launch", b))
        job = ReduceJob(bucket.grads, bucket.bounds, self._slice_grads[b], residual=self._residuals[b])
        self._jobs[b] = self._reducer.submit(job)
        self._next_to_launch = b + 1

    @property
    def trainable_now(self) -> bool:
        """Whether any of this engine's parameters requires a gradient now (``toggle_optimizer`` turns
        off the other optimizers' parameters, the same way on every rank)."""
        return any(param.requires_grad for param in self.params)

    def finish_backward(self) -> None:
        """End of a synchronising backward: flush the remaining buckets and wait for all of them.

        Buckets holding parameters that produced no gradient on this rank are sent with zeros for
        those parameters, in plan order on every rank, so no rank waits for a bucket that never fills.
        Parameters that no rank used are left untouched by the step, as under DDP.
        """
        self._backward_open = False
        if not self._sync:
            self._reset_timing()  # `_used` keeps accumulating over the accumulation window
            return
        self._check_unchanged()
        self.clock.mark(_BACKWARD_END)  # where the autograd callback did not run (no gradient here)
        while self._next_to_launch < len(self.buckets):
            self._launch(self._next_to_launch)
        usage = self._start_usage_reduce()  # its latency hides behind the buckets' reductions
        jobs = [job for job in self._jobs if job is not None]
        assert len(jobs) == len(self.buckets)
        # on CUDA the compute stream waits here, once, for the communication stream; a bucket is done when
        # the event after its last collective is (not when this thread got to it)
        self._reducer.wait_all(jobs, then=self._average_slice)
        self._record_globally_unused(*usage)
        bucket_used = [any(s.index in self._globally_used for s in bucket.slots) for bucket in self.buckets]
        self._note_partly_used(bucket_used)
        for b, used in enumerate(bucket_used):
            # a bucket no rank used: no gradient, so the optimizer skips it (and its step count), as DDP
            self.sharding.shards[b].grad = self._slice_grads[b] if used else None
        if self.replicated:  # the optimizer steps whole parameters: the full averaged gradients, as ddp's
            self._expose(skip_unused=True)
        host_done = None if self.clock.uses_events else [self._host_done(job) for job in self._jobs]
        step = self.time_bucketing.step if self.time_bucketing is not None else None
        resolved = self.clock.finish(tag=(step, self._layout_generation))
        if resolved is not None:
            self.last_timeline = self._timeline(resolved, host_done)
            if self.time_bucketing is not None:
                ran_at, layout = self.clock.resolved_tag
                self.time_bucketing.observe(
                    self.last_timeline,
                    self._globally_used,
                    step=ran_at,
                    same_layout=layout == self._layout_generation,
                )
        self._reset_backward_state()

    def _average_slice(self, b: int, job: ReduceJob) -> None:
        """Bucket ``b`` is reduced (on CUDA: ordered before what the current stream does next): average it."""
        self.clock.mark_event(("done", b), job.done_event)
        if self.world_size > 1:
            self._slice_grads[b].div_(self.world_size)

    def _host_done(self, job: ReduceJob | None) -> float:
        """CPU: when the thread saw the all-reduce finish (earlier than this thread's wait)."""
        assert job is not None
        return job.done_at - perf_counter() + self.clock.host_seconds()

    @torch.no_grad()
    def expose_full_gradients(self) -> None:
        """Make every parameter's ``.grad`` the averaged full gradient (an intra-node all-gather).

        After :meth:`finish_backward` each rank holds only its slice of the averaged gradient;
        hooks that read ``param.grad`` (gradient-norm logging) would see the local one. With one
        device per node the bucket was reduced in place and there is nothing to do.
        """
        if not self.replicated:  # replicated: finish_backward exposed them already
            self._expose()

    @torch.no_grad()
    def _expose(self, skip_unused: bool = False) -> None:
        """The all-gather of :meth:`expose_full_gradients`; ``skip_unused``: a parameter no rank used gets
        ``.grad = None`` afterwards, so the optimizer skips it (no decay, no state change), as under ddp."""
        if self.topology.devices_per_node > 1:
            self._gather_gradient_slices()
        if skip_unused and self._globally_used is not self._every_parameter:
            for index, param in enumerate(self.params):
                if index not in self._globally_used:
                    param.grad = None

    def _gather_gradient_slices(self) -> None:
        works = []
        for bucket, shard in zip(self.buckets, self.sharding.shards):
            start, end = bucket.owned_range
            if shard.grad is None:
                bucket.grads[start:end].zero_()
            else:
                bucket.grads[start:end].copy_(shard.grad)
            works.extend(all_gather_slices(bucket.grads, bucket.bounds, self.topology.intra_group))
        for work in works:
            work.wait()

    def _timeline(self, resolved: dict[Any, float], host_done: list[float] | None) -> StepTimeline:
        """A step's timeline from its resolved clock marks (seconds after backward started)."""
        launch = [resolved[("launch", b)] for b in range(len(self.buckets)) if ("launch", b) in resolved]
        done = (
            host_done
            if host_done is not None
            else [resolved.get(("done", b), 0.0) for b in range(len(launch))]
        )
        return StepTimeline(
            backward_start=0.0,
            backward_end=resolved.get(_BACKWARD_END, 0.0),
            ready=[resolved.get(("ready", i)) for i in range(len(self.params))],
            bucket_bytes=[b.numel * b.params.element_size() for b in self.buckets][: len(launch)],
            bucket_launch=launch,
            bucket_done=done,
        )

    def _reset_backward_state(self) -> None:
        for ready in self._ready:
            ready.clear()
        self._jobs = [None] * len(self.buckets)
        self._next_to_launch = 0
        self._used[:] = bytes(len(self._used))
        self._reset_timing()

    def _reset_timing(self) -> None:
        self.clock.reset()
        self._end_callback_queued = False

    def _start_usage_reduce(self) -> tuple[torch.Tensor, dist.Work | None]:
        """Start the MAX all-reduce of this rank's used-parameter flags (one tiny host collective per
        step; no flag to get wrong, unlike DDP's ``find_unused_parameters``). It runs on the world group,
        which no reducer thread uses, so it may overlap the buckets' reductions under any backend."""
        used = torch.tensor(self._used, dtype=torch.int32)
        if self.world_size == 1:
            return used, None
        work = dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.topology.world_group, async_op=True)
        return used, work

    def _record_globally_unused(self, used: torch.Tensor, work: dist.Work | None) -> None:
        """Remember parameters no rank used, so the step leaves them (and their state) untouched.

        DDP leaves such parameters' ``.grad`` as ``None`` and optimizers skip them; a flat slice
        cannot skip part of itself, so we snapshot those elements and restore them after the step.
        """
        if work is not None:
            work.wait()
        flags = used.tolist()
        unused = [index for index, flag in enumerate(flags) if not flag]
        self._globally_used = (
            frozenset(index for index, flag in enumerate(flags) if flag) if unused else self._every_parameter
        )
        for index in self._globally_used:
            self._used_steps[index] += 1
        if not self.replicated:  # a replicated optimizer skips them itself (their .grad is None)
            self._unused_snapshot = snapshot_unused(
                unused, self._where, self.buckets, self.sharding.shards, self.optimizer
            )

    def _check_unchanged(self) -> None:
        """Refuse parameter changes made after setup that the flat buckets cannot follow.

        DDP raises on these too; silently, this strategy would train a stale copy or nothing.
        """
        replaced = [param.data_ptr() for param in self.params] != self._param_pointers  # the fast common case
        for index, param in enumerate(self.params if replaced else ()):
            bucket_index, slot = self._where[index]
            view = self.buckets[bucket_index].param_view(slot)
            if param.data_ptr() != view.data_ptr():
                # e.g. ModelPruning's lottery-ticket reset assigns .data: take the new values back
                # into the bucket, as long as they fit the slot
                data = param.data
                if data.shape != view.shape or data.dtype != view.dtype or data.device != view.device:
                    raise RuntimeError(
                        f"parameter {self.param_names[index]!r}: its .data was replaced after setup by a "
                        f"{tuple(data.shape)} {data.dtype} tensor on {data.device}, but hier_sliced holds it "
                        f"as a {tuple(view.shape)} {view.dtype} view on {view.device} in a flat bucket. "
                        "Change values in place, or set the parameter up that way before trainer.fit."
                    )
                with torch.no_grad():
                    view.copy_(data)
                param.data = view
        groups_at_setup = len(self._original_groups)
        check_no_new_parameters(self.optimizer, groups_at_setup, self._frozen_at_setup, "hier_sliced")

    def _note_partly_used(self, bucket_used: list[bool]) -> None:
        """Parameters unused in a step while others of their bucket were used get buckets of their own.

        Their elements are restored after the step, but the slice's step count (Adam's bias
        correction, ...) advanced for all of it; from the next step on they keep their own count.
        The sets are the same on every rank (from the all-reduced usage), so every rank rebuilds.
        """
        if not self._step_counted:
            return
        for bucket, used in zip(self.buckets, bucket_used):
            if used and len(bucket.slots) > 1:
                self._to_isolate.update(s.index for s in bucket.slots if s.index not in self._globally_used)

    def _with_isolated(self, plan: BucketPlan) -> BucketPlan:
        buckets: list[tuple[int, ...]] = []
        for bucket in plan.buckets:
            rest = tuple(i for i in bucket if i not in self._isolated)
            if rest:
                buckets.append(rest)
            buckets.extend((i,) for i in bucket if i in self._isolated)
        return BucketPlan(tuple(buckets), kind=plan.kind)

    def _isolate_new(self, plan: BucketPlan) -> None:
        """Rebuild with the newly partly-used parameters alone, each with its own step count."""
        fresh, self._to_isolate = self._to_isolate, set()
        self._isolated |= fresh
        self.rebuild(self._with_isolated(plan))
        log.info(
            "hier_sliced: %d parameter(s) unused in some steps now have buckets of their own", len(fresh)
        )
        for index in fresh:
            state = self.optimizer.state.get(self.sharding.shards[self._where[index][0]], {})
            step = state.get("step")
            if torch.is_tensor(step):
                step.fill_(self._used_steps[index])
            elif step is not None:
                state["step"] = self._used_steps[index]

    # ------------------------------------------------------------------ step
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return self.sharding.clip_grad_norm_(max_norm, norm_type)

    @torch.no_grad()
    def after_step(self, clear_gradients: bool = True) -> None:
        """Restore untouched parameters, all-gather updated slices in the node, clear gradients
        (``clear_gradients=False``: leave that to the next ``zero_grad``, as Lightning's loop does).

        With ``bucketing="time"`` this is also where a new plan, once decided, takes effect.
        """
        if not self.replicated:  # replicated: every rank made the same step on the whole model
            self._unused_snapshot.restore(self.sharding.shards, self.optimizer)
            self.gather_params()
        if clear_gradients:
            self.zero_grad()
        plan = None
        if self.time_bucketing is not None:
            new_plan = self.time_bucketing.after_step(self._globally_used)
            if new_plan is not None:
                log.info("time bucketing: %s", new_plan.describe())
                plan = new_plan.plan
        if self._to_isolate:
            self._isolate_new(plan or self.bucket_plan)
        elif plan is not None:
            self.rebuild(self._with_isolated(plan))

    @torch.no_grad()
    def gather_params(self) -> None:
        """Fill every rank's full parameters from the slices' owners inside the node (in place)."""
        works = []
        for bucket in self.buckets:
            works.extend(all_gather_slices(bucket.params, bucket.bounds, self.topology.intra_group))
        for work in works:
            work.wait()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Clear the local gradient buckets. ``set_to_none``: also unset every parameter's ``.grad``, as
        ``optimizer.zero_grad()`` does (the next backward's gradient is taken back into its bucket)."""
        for bucket in self.buckets:
            bucket.grads.zero_()
        if set_to_none:
            for param in self.params:
                param.grad = None

    # ------------------------------------------------------------------ checkpoints and teardown
    def optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer's ``state_dict()`` as ``ddp`` gives it: ``params`` numbered as the param groups were
        built, each parameter's state shaped like the parameter, the same on every rank. Checkpoints hold it,
        and the user's optimizer object answers it to ``state_dict()`` while sharded.

        With a sharded optimizer this is a collective: call it on every rank, as Lightning's checkpointing
        does (each node gathers its ranks' slices)."""
        if self.optimizer_given_back:
            return self.optimizer.state_dict()
        return self.sharding.consolidated_state_dict()

    def load_optimizer_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` in ``ddp``'s layout (:meth:`optimizer_state_dict`): each rank takes its
        slices, without communication. The user's optimizer object does this on ``load_state_dict()`` while
        sharded."""
        if self.optimizer_given_back:
            self.optimizer.load_state_dict(state_dict)
        else:
            self.sharding.load_consolidated_state_dict(state_dict)

    def _sharded_now(self) -> bool:
        """Whether the optimizer's param groups hold this engine's flat slices now."""
        sharding = self.sharding
        sharded = isinstance(sharding, OptimizerSharding) and sharding.holds_slices
        return sharded and not self.optimizer_given_back

    def _user_state_dict(self) -> dict[str, Any]:
        """What the user's optimizer object answers to ``state_dict()``: while sharded,
        :meth:`optimizer_state_dict` (``ddp``'s layout, consolidated on demand); else its class's own.

        While sharded this is a collective: call it on every rank, as Lightning's checkpointing does."""
        if self._sharded_now():
            return self.optimizer_state_dict()
        return type(self.optimizer).state_dict(self.optimizer)

    def _user_load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """What the user's optimizer object does on ``load_state_dict()``: while sharded,
        :meth:`load_optimizer_state_dict` (``ddp``'s layout, each rank takes its slices); else its class's
        own."""
        if self._sharded_now():
            self.load_optimizer_state_dict(state_dict)
        else:
            type(self.optimizer).load_state_dict(self.optimizer, state_dict)

    def _route_state_dict(self) -> None:
        """The sharded optimizer's ``state_dict()`` and ``load_state_dict()`` speak the layout of the
        optimizer the user built, not that of the flat slices its param groups hold: attributes of the
        object over its class's methods, until :meth:`give_back_optimizer`. (``torch.optim.Optimizer``
        pickles and copies without them.)"""
        self.optimizer.state_dict = self._user_state_dict  # type: ignore[method-assign]
        self.optimizer.load_state_dict = self._user_load_state_dict  # type: ignore[method-assign]

    def _unroute_state_dict(self) -> None:
        """The optimizer's class's ``state_dict`` and ``load_state_dict`` again (unless another engine has
        routed them since)."""
        routed = {"state_dict": self._user_state_dict, "load_state_dict": self._user_load_state_dict}
        for name, method in routed.items():
            if self.optimizer.__dict__.get(name) == method:
                del self.optimizer.__dict__[name]

    def give_back_optimizer(self) -> None:
        """The optimizer steps the module's parameters again, with its full state (a collective over the
        node); the engine is done with it."""
        assert self.sharding is not None
        if self.optimizer_given_back:
            return
        self._unroute_state_dict()
        self.sharding.unshard()
        self.optimizer.__dict__.pop("zero_grad", None)  # a routed zero_grad (manual optimization)
        if self.optimizer.__dict__.get(_HELD_BY) is self:
            del self.optimizer.__dict__[_HELD_BY]
        self.optimizer_given_back = True

    def close(self) -> None:
        """Remove the hooks and stop the communication thread (parameters stay as they are)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._reducer.close()


def give_back_left_held(optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` back to its module parameters, with its full state, if an earlier engine still holds
    it: a fit that raised leaves it so (its peers may be gone, so teardown waits in no collective), and a
    later fit on a new Trainer or the same one starts from what ``ddp`` would have left. For a sharded
    optimizer a collective over that engine's node, which every rank reaches alike (a new engine is built at
    setup); for one kept whole, local."""
    engine = optimizer.__dict__.get(_HELD_BY)
    if engine is None:
        return
    if engine._sharded_now() or (engine.replicated and not engine.optimizer_given_back):
        engine.give_back_optimizer()


def trainable_params(groups: Sequence[Sequence[nn.Parameter]]) -> tuple[list[nn.Parameter], list[int]]:
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


def take_in_new_parameters(engines: Sequence[HierSlicedEngine]) -> bool:
    """:meth:`HierSlicedEngine.take_in_new_parameters` for every optimizer's engine (each decides alike on
    every rank from host flags, and only one that changed communicates); returns whether any did. A
    parameter one engine took in is no longer a frozen one to the others."""
    if len(engines) > 1 and any(engine.has_new_parameters() for engine in engines):
        optimizers = [engine.optimizer for engine in engines]
        refuse_shared_parameters(optimizers, engines[0].module, [engine._user_groups() for engine in engines])
    changed = [engine.take_in_new_parameters() for engine in engines]
    if any(changed) and len(engines) > 1:
        trained = {id(param) for engine in engines for param in engine.params}
        for engine in engines:
            engine._frozen_at_setup = [(n, p) for n, p in engine._frozen_at_setup if id(p) not in trained]
    return any(changed)


class TrainedParameters:
    """Every engine's trained parameters, read when iterated: a layout may take new ones in during fit."""

    def __init__(self, engines: Callable[[], Sequence[HierSlicedEngine]]) -> None:
        self._engines = engines

    def __iter__(self) -> Iterator[nn.Parameter]:
        return (param for engine in self._engines() for param in engine.params)


def _same_parameters(params: Sequence[torch.Tensor], original: Sequence[nn.Parameter]) -> bool:
    return len(params) == len(original) and all(a is b for a, b in zip(params, original))


def _names_of(module: nn.Module, params: Sequence[nn.Parameter]) -> list[str]:
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=True)}
    return [names.get(id(p), f"<param {i}>") for i, p in enumerate(params)]
