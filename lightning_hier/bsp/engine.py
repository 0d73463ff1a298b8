"""``BSPEngine``: one worker of ``hier_bsp`` with its shared-memory module, local BSP module and server shard.

The worker's side of a micro-step is two calls around the user's forward/backward::

    engine.begin_step()      # pick up the newest model; wait only if a whole superstep ahead
    ...forward, backward...  # gradients land in flat buffers behind the parameters' .grad
    engine.end_step()        # fold them into the aggregate; the local BSP module does the rest

``drain()`` stops the worker until every gradient it folded is applied and the final model is in its
parameters (epoch ends, validation, checkpoints, exit: the same model on every rank); the next
``begin_step()`` resumes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from lightning_hier.bsp.liveness import PeerWatch, describe_stall, peer_check_seconds
from lightning_hier.bsp.local_module import LocalBSPModule, SuperstepRecord
from lightning_hier.bsp.server import ShardedParameterServer
from lightning_hier.bsp.settings import BSPSettings
from lightning_hier.bsp.shared_memory import BSPStopped, SharedModelMemory
from lightning_hier.bucketing.size_plan import BucketPlan, ParamInfo, plan_size_buckets
from lightning_hier.bucketing.step_clock import StepClock
from lightning_hier.bucketing.time_bucketing import ReadyTimes
from lightning_hier.bucketing.time_plan import TimePlan, plan_time_buckets
from lightning_hier.sliced.engine import trainable_params
from lightning_hier.sliced.flat_buckets import FlatBucket, adopt_gradient, build_flat_buckets
from lightning_hier.sliced.sharded_optim import (
    check_no_new_parameters,
    check_server_optimizer,
    frozen_parameters,
    with_added_groups,
)
from lightning_hier.sliced.slicing import SlicePlan
from lightning_hier.topology import Topology

log = logging.getLogger(__name__)


class BSPEngine:
    """Runs ``module``'s training as a ``hier_bsp`` worker; ``optimizer`` becomes the server's.

    ``topology`` must hold groups that only this engine uses (its thread issues on them while the
    main thread runs Lightning's own collectives on others).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        topology: Topology,
        settings: BSPSettings,
        slice_plan: SlicePlan | None = None,
        bucket_cap_mb: float = 25.0,
        timeout_s: float = 1800.0,
        elementwise_optimizers: Sequence[str] = (),
        early_push: bool = False,
        plan: BucketPlan | None = None,
        profile: tuple[int, int] | None = None,
        inter_node_dtype: torch.dtype | None = None,
    ) -> None:
        """``plan``: the buckets (default: by size, up to ``bucket_cap_mb``). ``profile``: ``(warmup, steps)``
        to time when each gradient is ready in the last backward of that many micro-steps, after skipping
        ``warmup``, for :meth:`time_plan`. ``inter_node_dtype``: the dtype of the push across nodes
        (:mod:`lightning_hier.sliced.compressed_hop`; ``None``: the gradients' own)."""
        devices_per_node = topology.devices_per_node if topology is not None else None
        check_server_optimizer(optimizer, elementwise_optimizers, devices_per_node)
        # plain BSP only: there a worker's last micro-step of a superstep is known before its backward
        self.early_push = early_push and settings.lockstep
        self.settings = settings
        self.topology = topology
        self.timeout_s = timeout_s
        self.optimizer = optimizer
        original_groups = [list(group["params"]) for group in optimizer.param_groups]
        # what the server's optimizer does not hold: taken in by a new engine (has_new_parameters), checked
        # every step (check_no_new_parameters)
        self._groups_at_setup = len(original_groups)
        self._frozen_at_setup = frozen_parameters(module)
        self.params, group_of = trainable_params(original_groups)
        if not self.params:
            raise ValueError(
                "the optimizer holds no trainable parameters (all have requires_grad=False): hier_bsp's "
                "server needs one at setup (hier_sliced also takes in an optimizer whose parameters are all "
                "unfrozen later)."
            )
        trained = {id(p) for p in self.params}
        self._frozen_in_groups = [p for group in original_groups for p in group if id(p) not in trained]
        self.profile = profile
        self.infos = [
            ParamInfo(i, p.numel(), p.element_size(), (group_of[i], p.dtype, p.device))
            for i, p in enumerate(self.params)
        ]
        plan = plan or plan_size_buckets(self.infos, int(bucket_cap_mb * 1024 * 1024))
        self.bucket_plan = plan
        slice_plan = slice_plan or SlicePlan((1.0,) * topology.devices_per_node)
        self.server = ShardedParameterServer(
            self.params, group_of, optimizer, original_groups, topology, plan, slice_plan, inter_node_dtype
        )
        self.buckets: list[FlatBucket] = build_flat_buckets(
            self.params, plan, slice_plan, topology.local_rank
        )
        self.memory = SharedModelMemory([b.params for b in self.buckets], settings, len(self.params))
        self._resumed_in_epoch = False  # whether this worker's module resumed in the current epoch
        self._bucket_of = {slot.index: b for b, bucket in enumerate(self.buckets) for slot in bucket.slots}
        # each parameter's .grad view in its bucket, made once (every micro-step re-checks all of them)
        self._grad_views = [None] * len(self.params)
        for bucket in self.buckets:
            for slot in bucket.slots:
                self._grad_views[slot.index] = bucket.grad_view(slot)
        self._ready_in_bucket = [0] * len(self.buckets)
        # the coming backward completes a micro-step (set before it); whether that micro-step is the
        # superstep's last, decided at its first gradient; buckets 0.. of it folded so far
        self._completing = False
        self._armed: bool | None = None
        self._folded_early = 0
        # which parameters got a gradient in the current micro-step (a parameter no worker used in a
        # superstep is left untouched by the server's step, as ddp leaves it)
        self._used = [False] * len(self.params)
        self._hooks = [
            param.register_post_accumulate_grad_hook(partial(self._mark_used, index))
            for index, param in enumerate(self.params)
        ]
        # gradient-ready times in the profiled micro-steps' last backward
        self._clock = StepClock(self.params[0].device) if profile is not None else None
        self._profile_warmup, self._profile_steps = profile if profile is not None else (0, 0)
        self._ready = ReadyTimes(len(self.params))
        self.module = LocalBSPModule(self.memory, self.server, topology, settings, timeout_s)
        self._peers = PeerWatch(self.module.run_key, topology.world_size, peer_check_seconds(timeout_s))
        self.module.start()

    def _mark_used(self, index: int, param: torch.Tensor) -> None:
        self._used[index] = True
        if not self._completing:
            return
        if self._clock is not None and self._clock.started:
            self._clock.mark(index)
        if self._armed is None:  # begin_step has run by now: the count of micro-steps is current
            self._armed = self.early_push and self.memory.started_since_pickup == self.settings.quota
            self._ready_in_bucket = [0] * len(self.buckets)
        if self._armed:
            self._ready_in_bucket[self._bucket_of[index]] += 1
            self._fold_ready_buckets()

    @torch.no_grad()
    def _fold_ready_buckets(self) -> None:
        """Fold the leading buckets whose gradients are all in, so the local module can push them
        while backward goes on (the push order, bucket 0 first, is the same on every rank)."""
        memory, start = self.memory, self._folded_early
        while self._folded_early < len(self.buckets) and self._ready_in_bucket[self._folded_early] == len(
            self.buckets[self._folded_early].slots
        ):
            self._collect_grads(self.buckets[self._folded_early])
            self._folded_early += 1
        if self._folded_early == start:
            return
        with memory.cond:
            for b in range(start, self._folded_early):
                memory.aggregate.fold_bucket(b, self.buckets[b].grads)
            memory.handoff.worker_hands_over()
            memory.ready_buckets = self._folded_early
            memory.notify()

    def backward_starts(self) -> None:
        """The closure's backward begins (the zero of the gradient-ready times while profiling)."""
        if self._clock is not None and self._completing:
            self._clock.start()

    def expect_last_backward(self) -> None:
        """Call before the backward that completes a micro-step (with gradient accumulation, the last
        one): in plain BSP, if that micro-step is the worker's last of the superstep, its buckets are
        folded, and pushed, as they fill."""
        self._completing, self._armed, self._folded_early = True, None, 0

    # ------------------------------------------------------------------ worker
    def new_epoch(self) -> None:
        """An epoch starts (or a fit): the module, paused at the last epoch's end, has not resumed in it yet
        (a micro-step resumes it; see :meth:`drain`)."""
        self._resumed_in_epoch = False

    def _resume(self) -> None:
        memory = self.memory
        self._resumed_in_epoch = True
        if memory.paused:
            memory.paused = memory.draining = memory.epoch_ended = memory.peer_epoch_ended = False
            memory.fit_ended = memory.peer_fit_ended = False
            memory.handoff.worker_hands_over()  # what the worker wrote meanwhile (a checkpoint's load)
            memory.notify()

    @torch.no_grad()
    def begin_step(self) -> None:
        """Resume after a drain, pick up the newest model, and wait while a whole superstep ahead."""
        memory = self.memory
        with memory.cond:
            memory.raise_if_failed()
            memory.cycle_ends(time.monotonic())
            self._resume()
            while True:
                self._pick_up()
                # after fit (the module has ended) nobody announces models: a step run then (Lightning's
                # own tests run the training loop's step by hand) computes without waiting
                if not memory.blocked() or not self.module.is_alive():
                    break
                self._wait("new model from the parameter server")
            memory.in_flight = memory.picked_up
            memory.started_since_pickup += 1
            memory.cycle_starts(time.monotonic())
        # the gradients are cleared by the optimizer's zero_grad (routed here), where Lightning calls it:
        # a module whose optimizer_zero_grad skips batches adds them to the next micro-step, as under ddp

    @torch.no_grad()
    def end_step(self, computed: bool = True) -> None:
        """Fold this micro-step's gradients into the aggregate (``computed=False``: a skipped step)."""
        memory = self.memory
        if computed:
            check_no_new_parameters(self.optimizer, self._groups_at_setup, self._frozen_at_setup, "hier_bsp")
        for bucket in self.buckets[self._folded_early :]:
            self._collect_grads(bucket)
        with memory.cond:
            if computed:
                grads = [b.grads for b in self.buckets]
                memory.aggregate.fold(grads, memory.in_flight, self._used, folded=self._folded_early)
                memory.handoff.worker_hands_over()
                if self._armed:
                    memory.ready_buckets = len(self.buckets)  # the rest may go with the others' buckets
                # the settings this step was taken with (an LR scheduler may change them before the close)
                memory.hyper = [
                    {k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups
                ]
            else:
                # nothing folded (training_step returned None, which Lightning allows on one process): it
                # does not count toward the superstep's quota, which it could never fill (waited forever)
                memory.started_since_pickup -= 1
            memory.in_flight = -1
            memory.micro_step_folded(time.monotonic())
            memory.notify()
        self._completing, self._armed, self._folded_early = False, None, 0
        if self._clock is not None:
            self._take_ready_times(self._clock.finish() if computed else self._clock.reset())

    def _take_ready_times(self, times: dict | None) -> None:
        """Add one resolved micro-step's ready times (on CUDA the previous one's) once past the warmup."""
        if not times:
            return
        if self._profile_warmup > 0:
            self._profile_warmup -= 1
            return
        self._ready.add([times.get(i) for i in range(len(self.params))], max(times.values()))

    @property
    def wants_time_plan(self) -> bool:
        """Enough micro-steps profiled for :meth:`time_plan`."""
        return self._clock is not None and self._ready.steps >= self._profile_steps

    def time_plan(self, cap_bytes: int, min_bytes: int) -> TimePlan:
        """Buckets clustered by when gradients became ready, averaged over the profiled micro-steps and
        every rank (drains first; the mean is a collective, issued by the local BSP module's thread).
        Profiling stops here."""
        self.drain()
        stats, world = self._ready.packed(), self.topology.world_group
        self.module.call(lambda: torch.distributed.all_reduce(stats, group=world))
        ready, backward_s = ReadyTimes.means(stats)
        self._clock = None
        return plan_time_buckets(self.infos, ready, backward_s, cap_bytes, min_bytes)

    @torch.no_grad()
    def zero_grad(self) -> None:
        """Zero the worker's gradients; every parameter's ``.grad`` is (again) a view into its bucket."""
        self._used = [False] * len(self.params)
        for bucket in self.buckets:
            bucket.grads.zero_()
        for param, view in zip(self.params, self._grad_views):
            if param.grad is not view:
                param.grad = view

    @torch.no_grad()
    def _collect_grads(self, bucket: FlatBucket) -> None:
        """Take in gradients autograd put elsewhere (after a ``zero_grad(set_to_none=True)``, or sparse)."""
        for slot in bucket.slots:
            adopt_gradient(self.params[slot.index], self._grad_views[slot.index], accumulate=True)

    def set_clipping(self, clip: tuple[str, float] | None) -> None:
        """Gradient clipping the server applies to the mean gradient of every superstep."""
        with self.memory.cond:
            self.memory.clip = clip

    @torch.no_grad()
    def drain(self, epoch_end: bool = False, fit_end: bool = False, rejoin: bool = False) -> None:
        """Apply everything folded on every rank, then copy the final model (a collective).
        ``epoch_end``: this worker ran out of batches; the others end their epochs too. ``fit_end``: this
        worker reached max_steps; the others end the fit too (:attr:`fit_should_end` on every rank after
        the drain: the flag is in the same status row as the drain request, so every rank has read it
        before all of them pause). ``rejoin`` (at an epoch's end): a worker without a micro-step in this
        epoch (every batch it drew was skipped, or it drew none) never resumed its module after the last
        drain, while the workers that trained did and now wait in their drain for every module: it
        resumes here and drains with them."""
        memory = self.memory
        with memory.cond:
            memory.raise_if_failed()
            if rejoin and memory.paused and not self._resumed_in_epoch and self.module.is_alive():
                self._resume()
            # aborted: the module stops without a drain; ended (after fit): nothing left to drain
            if not memory.paused and not memory.aborted and self.module.is_alive():
                memory.draining = True
                memory.epoch_ended = epoch_end
                memory.fit_ended = fit_end
                memory.notify()
                while not memory.paused:
                    self._wait("drain of every worker")
            self._pick_up()

    def _wait(self, what: str) -> None:
        """Wait (lock held) for news from the local BSP module, as ``memory.wait`` does, up to the timeout;
        after each ``every_s`` of the :class:`PeerWatch` without news, compare the ranks' heartbeats and
        stop with an error naming a lost rank.

        Under NCCL a collective whose peer died need not fail: the module's thread waits on the device
        until NCCL's watchdog ends the process at the groups' timeout (the same as this one) with a
        message that names no rank. This names the rank after two such periods, at most a third of the
        timeout. (Over gloo a dead peer's collective fails at once, and the module names the rank; a CPU
        test stands in a push that never returns for the NCCL wait, which only a GPU run can show.)"""
        memory, started = self.memory, time.monotonic()
        while True:
            left = self.timeout_s - (time.monotonic() - started)
            if left <= 0:
                raise BSPStopped(f"hier_bsp: no {what} after {time.monotonic() - started:.0f} s (timeout).")
            if memory.cond.wait(min(left, self._peers.every_s)):
                memory.raise_if_failed()
                return
            memory.raise_if_failed()
            lost = self._peers.check()  # a few reads of the job's store, no sleep
            if lost is None or lost:
                message = describe_stall(lost, time.monotonic() - started, what)
                log.error("hier_bsp: %s", message)  # at once: NCCL's watchdog may end the process soon
                memory.fail(RuntimeError(message))
                memory.raise_if_failed()

    def _pick_up(self) -> None:
        memory = self.memory
        if memory.picked_up != memory.version:
            memory.handoff.worker_takes_over()
            for bucket, published in zip(self.buckets, memory.published):
                bucket.params.copy_(published)
            memory.handoff.worker_hands_over()  # the module may overwrite the published model after this
            memory.picked_up = memory.version
            memory.started_since_pickup = 0

    @torch.no_grad()
    def await_stepped_model(self) -> None:
        """In lockstep, after the superstep's last micro-step: wait for the model the server makes of it
        and take it into the parameters now, rather than at the next :meth:`begin_step`, so the hooks
        after the optimizer step (``on_train_batch_end``: EMA weight averaging, weight logging, a
        checkpoint every n steps) see the stepped weights, as under ``ddp``. Lockstep waits for that
        model before the next micro-step anyway; elsewhere a worker goes on without it."""
        memory, quota = self.memory, self.settings.quota
        if not self.settings.lockstep or quota is None:
            return
        with memory.cond:
            if memory.started_since_pickup < quota:
                return  # the superstep wants more micro-steps (or this one computed nothing)
            while (
                memory.picked_up == memory.version
                and not (memory.paused or memory.draining or memory.aborted)
                and self.module.is_alive()
            ):
                self._wait("new model from the parameter server")
            self._pick_up()

    @property
    def fit_should_end(self) -> bool:
        """Some worker reached max_steps: end the fit here too (all then drain together)."""
        return self.memory.peer_fit_ended or self.memory.fit_ended

    @property
    def epoch_should_end(self) -> bool:
        """Another worker ran out of batches: end this epoch too (all then drain together). Never in
        lockstep: there every worker has as many batches as the others and ends at its own last one. A
        peer may fold a superstep's later micro-steps, and drain at its epoch's end, while this worker
        still computes an earlier one; ending here would drop this worker's remaining batches from the
        superstep, depending on who got there first."""
        return self.memory.peer_epoch_ended and not self.settings.lockstep

    @property
    def records(self) -> list[SuperstepRecord]:
        return self.module.records

    def abort(self) -> None:
        """The worker's training raised: leave the micro-step it was in, and stop without a drain. The
        local module tells the others at its next tick; their workers stop with an error naming this rank
        instead of waiting for its gradients until the timeout. :meth:`close` then only ends the thread."""
        with self.memory.cond:
            self.memory.aborted = self.memory.stopping = True
            self.memory.in_flight = -1
            self.memory.notify()

    def close(self) -> None:
        """Drain, then stop the local BSP module (a collective: every rank calls it; after :meth:`abort`
        or a failure, only the stop)."""
        if self.module.is_alive() and self.memory.error is None and not self.memory.aborted:
            self.drain()
        with self.memory.cond:
            self.memory.stopping = True
            self.memory.cond.notify_all()
        self.module.join(timeout=10.0)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # ------------------------------------------------------------------ parameters gained during fit
    def has_new_parameters(self) -> bool:
        """Whether the optimizer gained parameters this engine's server does not step: a param group added
        (``add_param_group``), or a parameter of its groups frozen at setup and trainable now. The strategy
        then builds a new engine over them between steps (:meth:`take_over`). Off lockstep only where every
        worker is drained (an epoch's start, as ``BaseFinetuning`` unfreezes): workers elsewhere are at
        different steps, and the rebuild is a collective. Host flags only: it may run every step."""
        changed = len(self.optimizer.param_groups) != self._groups_at_setup or any(
            param.requires_grad for param in self._frozen_in_groups
        )
        if changed and not self.settings.lockstep and not self.memory.paused:
            raise RuntimeError(
                "hier_bsp: the optimizer gained parameters (add_param_group, or a parameter of its groups "
                "unfrozen) in the middle of an epoch while the workers run free, at different steps: "
                "unfreeze at an epoch's start (a callback's on_train_epoch_start, as Lightning's "
                "BaseFinetuning does), or train in lockstep (max_staleness=0 and a superstep of a step "
                "count)."
            )
        return changed

    @torch.no_grad()
    def take_over(self, state: dict[str, Any]) -> None:
        """Continue from an engine this one replaces: its consolidated optimizer ``state`` (param groups
        added to the optimizer since start without state, as torch starts them) and the worker's
        parameters as every copy's model."""
        self.server.sharding.load_consolidated_state_dict(
            with_added_groups(state, self.optimizer.param_groups)
        )
        self.load_params()

    # ------------------------------------------------------------------ checkpoints
    def optimizer_state_dict(self) -> dict[str, Any]:
        """The unsharded optimizer's ``state_dict`` (drains first; a collective over the node, issued by
        the local BSP module's thread like every other collective on its groups)."""
        self.drain()
        if not self.module.is_alive():  # after close(): the module's thread has ended
            return self.server.sharding.consolidated_state_dict()
        return self.module.call(self.server.sharding.consolidated_state_dict)

    def load_optimizer_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.server.sharding.load_consolidated_state_dict(state_dict)

    @torch.no_grad()
    def load_params(self) -> None:
        """Take the worker's parameters (just loaded from a checkpoint) as the model of every copy."""
        for bucket, master, published in zip(self.buckets, self.server.buckets, self.memory.published):
            master.params.copy_(bucket.params)
            published.copy_(bucket.params)
