"""PipelineEngine: one stage process of a rebalancing pipeline (plain torch, no Lightning).

Every process holds the whole model object, but only its stage's parameters, buffers and
optimizer state have storage; the rest are empty tensors that stay registered, so the module,
its ``state_dict`` names and the optimizer's parameter groups keep their structure. Stage ``s`` of
replica ``r`` runs on global rank ``r * num_stages + num_stages - 1 - s`` (``pipeline/replicas.py``): the
last stage of replica 0, which computes the loss, is rank 0, where Lightning logs and saves. Repartitions
are decided on every stage of every replica alike, from the times all of them gathered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from lightning_hier.buffer_broadcast import RootBuffers
from lightning_hier.pipeline.activation_store import ActivationMeter, LayerRunner
from lightning_hier.pipeline.delegation import forward_delegate
from lightning_hier.pipeline.foreign_layers import ForeignLayerGuard
from lightning_hier.pipeline.graph import LayerGraph
from lightning_hier.pipeline.memory_policy import (
    KEEP,
    RECOMPUTE,
    SWAP,
    LayerMemoryStats,
    MemoryLimitError,
    MemoryPlan,
    decide_memory_plan,
    needs_new_plan,
)
from lightning_hier.pipeline.migration import (
    MigrationReport,
    materialize_state,
    migrate,
    named_state,
    plan_moves,
    release_state,
    state_on_host,
)
from lightning_hier.pipeline.object_wire import from_wire, to_wire
from lightning_hier.pipeline.partition import StagePartition, stage_costs
from lightning_hier.pipeline.rebalance import RebalanceDecision, cluster_costs, decide_rebalance
from lightning_hier.pipeline.replicas import (
    ReplicaGradients,
    ReplicaLayout,
    agree_with_replica_0,
    averaged_over_replicas,
    broadcast_from_replica_0,
)
from lightning_hier.pipeline.schedule import PipelineSchedule, StageLink
from lightning_hier.pipeline.settings import PipelineSettings
from lightning_hier.pipeline.stage import StageExecutor
from lightning_hier.pipeline.tied_parameters import (
    TiedParameter,
    canonical_names,
    find_tied,
    other_names,
    parameter_shapes,
    start_replicas_equal,
    sum_tied_gradients,
)
from lightning_hier.pipeline.time_table import (
    _DEVICE_COLUMNS,
    GatheredTimes,
    merge_stage_times,
    pack_stage_times,
)
from lightning_hier.pipeline.warmup import choose_extra_warmup, fits_in_memory
from lightning_hier.pipeline.weight_grad import WeightGradients
from lightning_hier.topology import all_ranks_group, control_group, subset_group

log = logging.getLogger(__name__)


def rank_of_stage(num_stages: int, stage: int) -> int:
    """The global rank of ``stage`` in a single pipeline (replica 0's: :class:`ReplicaLayout`)."""
    return num_stages - 1 - stage


# after a check that moved layers (and at the start), this many training micro-batches are all
# timed; then one micro-batch per timed step (see PipelineEngine.times_micro_batch)
FULLY_TIMED_MICRO_BATCHES = 8
# with rebalancing alone, after the first micro-batches about this many steps between two checks time one
# micro-batch each: samples enough for a check (a quiet check carries them on, aged), while on a long interval
# (rebalance="epoch" over hundreds of steps) timing costs a fraction of a timed micro-batch per step
TIMED_STEPS_PER_CHECK = 16
# a check that moved nothing keeps the stage's layer times at this weight against each new sample:
# the next check reads mostly its own window, so a drift shows within a check or two, yet needs no
# burst of full timing to have enough samples
TIMES_KEPT_AFTER_A_QUIET_CHECK = 0.5
LAYER_TIMING_MODES = ("auto", "sampled", "all", "off")


@dataclass
class RebalanceEvent:
    """One rebalance check that changed the partition, as seen from the last stage."""

    step: int
    decision: RebalanceDecision
    migration: list[dict[str, Any]] = field(default_factory=list)  # one report per stage
    pause_seconds: float = 0.0
    memory_plans: list[Any] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = self.decision
        return {
            "step": self.step,
            "reason": d.reason,
            "old": d.old.to_dict(),
            "new": d.new.to_dict() if d.new is not None else None,
            "stage_times": list(d.stage_times),
            "predicted_times": list(d.predicted_times),
            "imbalance_before": d.imbalance_before,
            "imbalance_after": d.imbalance_after,
            "migration": self.migration,
            "pause_seconds": self.pause_seconds,
            "memory_plans": self.memory_plans,
        }


class PipelineEngine:
    """Runs this process's stage: schedule, per-layer timing, rebalancing and migration.

    Args:
        graph: the traced model (shared submodules with ``graph.root``).
        partition: the initial split of ``graph``'s clusters, the same on every rank.
        stage: this process's stage; ``num_stages == partition.num_stages`` processes take part.
        device: where this stage computes.
        schedule: ``"1f1b"`` or ``"gpipe"``.
        group: the stage processes of this replica, with a CPU backend beside the device one (the device
            rule of :mod:`lightning_hier.topology`); default :func:`~lightning_hier.topology.all_ranks_group`.
        layout: where every replica's stages run (default: one replica, ``partition.num_stages`` processes).
        replica: this process's replica.
        replica_group: this stage's replicas (``pipeline/replicas.py``: ``build_groups``); ``None`` with one
            replica. Their gradients are averaged before the optimizer step.
    """

    def __init__(
        self,
        graph: LayerGraph,
        partition: StagePartition,
        stage: int,
        device: torch.device,
        schedule: str = "1f1b",
        settings: PipelineSettings | None = None,
        group: dist.ProcessGroup | None = None,
        timeout: timedelta | None = None,
        layout: ReplicaLayout | None = None,
        replica: int = 0,
        replica_group: Any = None,
    ) -> None:
        self.settings = settings or PipelineSettings(schedule=schedule)
        self.timeout = timeout  # of the groups this engine makes (the stages holding a tied parameter)
        self.group = group if group is not None else all_ranks_group(timeout)
        self.graph = graph
        self.root = graph.root
        self.partition = partition
        self.stage = stage
        self.num_stages = partition.num_stages
        self.device = device
        self.layout = layout or ReplicaLayout(self.num_stages)
        if self.layout.stages != self.num_stages or (self.layout.replicas > 1) != (replica_group is not None):
            raise ValueError(
                f"PipelineEngine: {self.layout} does not fit a partition of {self.num_stages} stages with "
                f"replica_group={replica_group!r}."
            )
        self.replica = replica
        self.replica_group = replica_group
        self.replica_gradients: ReplicaGradients | None = None
        self.replica_buffers: RootBuffers | None = None
        if replica_group is not None:
            self.replica_gradients = ReplicaGradients(replica_group, self.layout.replicas, device)
            self.replica_buffers = RootBuffers(self.layout.rank(0, stage), replica_group, device)
        # set per step by the strategy: this step's backward ends an accumulation window, so the replica
        # average may start in its last micro-batch's backward (``replica_overlap``; tests turn it off)
        self.step_synchronises = False
        self.replica_overlap = True
        self.optimizers: list[Optimizer] = []
        self.executor = StageExecutor(graph, partition, stage, device)
        self.link = StageLink(stage, self.num_stages, self._rank_of_stage, device, group=self.group)
        self.link.open_device_channel()  # before any step: the first exchange involves two stages only
        self.schedule = PipelineSchedule(self.link, schedule, on_backward_done=self._backward_done)
        if isinstance(self.settings.extra_warmup, int):
            self.schedule.extra_warmup = [self.settings.extra_warmup] * (self.num_stages - 1)
        self.history: list[RebalanceEvent] = []
        self.checks: list[dict[str, Any]] = []  # every check: step, reason, changed, measured stage times
        self.last_decision: RebalanceDecision | None = None
        self.steps = 0
        self._time_split_done = False
        self.meter: ActivationMeter | None = None
        self.runner: LayerRunner | None = None
        self.memory_plan: MemoryPlan | None = None
        self.memory_plans: list[dict[str, Any]] = []  # last stage: every stage's current plan
        self.memory_events: list[dict[str, Any]] = []  # last stage: each time the plans were decided
        self._kept_bytes: dict[str, int] = {}
        self.layer_table: dict[str, Any] = {"layers": {}, "input_bytes": {}, "saved_bytes": {}}
        self._measured_bandwidth: float | None = None
        self.layer_timing = "auto"  # one of LAYER_TIMING_MODES, see times_micro_batch
        # training steps between two rebalance checks where the settings do not say (rebalance="epoch": the
        # strategy sets the epoch's length); None: unknown, one timed micro-batch per step
        self.steps_per_check: int | None = None
        self._held_by_no_layer = self._state_no_layer_holds()
        # read while every tensor is whole: which names are one tensor, and each parameter's shape
        self._canonical = canonical_names(self.root)
        self._other_names = other_names(self._canonical)
        self._shapes = parameter_shapes(self.root)
        # by every name; the objects stay (a released tensor keeps its Parameter, only .data changes)
        self._params = dict(self.root.named_parameters(remove_duplicate=False))
        self.tied: list[TiedParameter] = []
        self._tied_groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}  # stages -> their group
        self._find_tied()
        if self.num_stages > 1:
            # rank 0's values, over a group holding rank 0 (every rank still holds the whole model)
            world = self.group if replica_group is None else all_ranks_group(timeout)
            start_replicas_equal(self.tied, self._params, world)
        delegate = forward_delegate(self.root)
        self.foreign_layers = ForeignLayerGuard(self.root, self.stage, self.num_stages, delegate)
        self.release_foreign_state()
        if replica_group is not None:  # every replica starts from replica 0's stage, as ddp from rank 0
            broadcast_from_replica_0(self._owned_state_tensors(), self.layout, self.stage, replica_group)
        self._enable_memory_policy()
        if self._splits_backward():
            executor = self.executor
            split = WeightGradients(executor.clock.mark, executor.is_timing)
            executor.weight_grads = self.schedule.weight_grads = split
            self._watch_weight_grads()

    def _backward_done(self) -> None:
        self.executor.finish_backward()
        if self.replica_gradients is not None:
            self.replica_gradients.backward_done()

    def _splits_backward(self) -> bool:
        """Whether this stage may split its backward (``split_backward``; never the first stage)."""
        return self.settings.split_backward and self.num_stages > 1 and self.stage > 0

    def _watch_weight_grads(self) -> None:
        """Point the split backward at this stage's layers and parameters (after every partition change)."""
        split = self.executor.weight_grads
        if split is None:
            return
        owned = [self._params[name] for name in self.owned_state_names() if name in self._params]
        split.watch(self.executor.stage_modules(), owned, self.executor.functional_parameters())

    def _rank_of_stage(self, stage: int) -> int:
        return self.layout.rank(self.replica, stage)

    @property
    def _last_rank(self) -> int:
        return self._rank_of_stage(self.num_stages - 1)

    def _gather_on_last(self, obj: Any) -> list[Any]:
        """Every stage's ``obj``, in stage-rank order, on the last stage; ``[]`` elsewhere (collective)."""
        if self.num_stages == 1:  # nothing to gather, and no pickling round trip
            return [obj]
        gathered: list[Any] = [None] * self.num_stages if self.is_last else []
        dist.gather_object(
            to_wire(obj), gathered if self.is_last else None, dst=self._last_rank, group=self.group
        )
        return [from_wire(part) for part in gathered]

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def owned_state_names(self, partition: StagePartition | None = None) -> list[str]:
        """The parameter and buffer names this stage holds under ``partition`` (default: the current one).

        Its layers' state under every name of the same tensors (a weight tied to a module that ``forward``
        never calls, or to a layer of another stage: then each of those stages holds a replica), and, on
        the last stage, whatever no traced layer uses: the last stage runs the user's ``*_step`` on the
        model's output, where such modules (a loss with weights, a learnable temperature) are called, and a
        checkpoint must hold them.
        """
        partition = partition or self.partition
        first, last = partition.stage_ranges()[self.stage]
        names = self.graph.state_names(first, last)
        if self.stage == partition.num_stages - 1:
            names += self._held_by_no_layer
        seen = set(names)
        for name in list(names):
            for other in self._other_names.get(name, ()):
                if other not in seen:
                    seen.add(other)
                    names.append(other)
        return names

    def _find_tied(self) -> None:
        """The parameters tied across stages under the current split, and a process group of the stages
        holding each in this replica (every rank calls this at the same points, the same list: building a
        group is a collective of all ranks, so each rank builds every replica's group in replica order;
        :func:`~lightning_hier.topology.subset_group` builds one per set of ranks and process, later fits
        reuse it)."""
        self.tied = find_tied(self.graph, self.partition, self._canonical, self._shapes)
        for tied in self.tied:
            if tied.stages in self._tied_groups:
                continue
            if len(tied.stages) == self.num_stages:
                self._tied_groups[tied.stages] = self.group
                continue
            for replica in range(self.layout.replicas):
                ranks = sorted(self.layout.rank(replica, stage) for stage in tied.stages)
                group = subset_group(ranks, self.timeout, role="tied")
                if replica == self.replica:
                    self._tied_groups[tied.stages] = group

    def _owned_state_tensors(self) -> list[torch.Tensor]:
        """This stage's parameters and buffers, each tensor once, in the order of its names (the same list
        in every replica)."""
        state = named_state(self.root)
        seen: set[int] = set()
        tensors = []
        for name in self.owned_state_names():
            tensor = state.get(name)
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                tensors.append(tensor)
        return tensors

    def average_replica_gradients(self) -> None:
        """Before the optimizer step: this stage's gradients averaged over its replicas (collective over
        them; nothing with one replica, nor where the backward's overlapped average already finished).
        Before the sums of tied parameters and the clipping norm, which then see the averaged gradients, as
        under ``ddp``."""
        averager = self.replica_gradients
        if averager is None or averager.finished:
            return
        if averager.pending:
            averager.finish()
            return
        averager.average(self._trainable_owned())

    def finish_replica_average(self) -> None:
        """After the backward of a step that started its average there: wait for it (nothing otherwise)."""
        if self.replica_gradients is not None and self.replica_gradients.pending:
            self.replica_gradients.finish()

    def _trainable_owned(self) -> list[torch.nn.Parameter]:
        owned = self._owned_state_tensors()
        return [t for t in owned if isinstance(t, torch.nn.Parameter) and t.requires_grad]

    def _arm_replica_average(self, num_micro: int) -> bool:
        """Whether this step's replica average starts in its last micro-batch's backward (see
        :meth:`ReplicaGradients.arm`). Not where this stage splits its backward: the weights' passes run
        outside that backward, later, and leave no gradient hook to start from. Clipping, tied parameters'
        sums and migrations stay correct with it: they run after :meth:`finish_replica_average`."""
        averager = self.replica_gradients
        if averager is None:
            return False
        averager.reset()
        if not (self.step_synchronises and self.replica_overlap) or self._splits_backward():
            return False
        averager.arm(self._trainable_owned(), num_micro - 1)
        return True

    def before_replica_forward(self, synchronises: bool) -> None:
        """Before a step's first forward: replica 0's buffers where ``ddp`` would broadcast rank 0's
        (:class:`~lightning_hier.buffer_broadcast.RootBuffers`; collective over the stage's replicas, nothing
        with one replica)."""
        if self.replica_buffers is not None:
            buffers = [t for t in self._owned_state_tensors() if not isinstance(t, torch.nn.Parameter)]
            self.replica_buffers.before_forward(buffers, synchronises)

    def sum_tied_gradients(self) -> None:
        """Before the optimizer step: every replica of a parameter tied across stages gets the sum of the
        replicas' gradients (collective over the stages; nothing when no parameter is tied across them)."""
        sum_tied_gradients(self.tied, self._params, self.stage, self.device, self._tied_groups)

    def _state_no_layer_holds(self) -> list[str]:
        """The parameter and buffer names whose tensor no traced layer uses under any name (another name of
        a layer's tensor goes with that layer: :meth:`owned_state_names`). Read once, while every tensor is
        still whole and distinct."""
        state = named_state(self.root)
        held = {
            id(state[name]) for name in self.graph.state_names(0, self.graph.num_clusters) if name in state
        }
        return [name for name, tensor in state.items() if id(tensor) not in held]

    def _foreign_state_names(self) -> list[str]:
        """The parameter and buffer names another stage owns under the current partition."""
        owned = set(self.owned_state_names())
        return [n for n in named_state(self.root) if n not in owned]

    def release_foreign_state(self) -> None:
        """Drop the storage of every parameter and buffer another stage owns."""
        foreign = self._foreign_state_names()
        release_state(self.root, foreign, self.optimizers)
        self.foreign_layers.refresh(foreign)

    def restore_full_model(self, device: torch.device | str = "cpu") -> None:
        """Give every rank's module the whole model again, as one process would hold it (collective).

        Each stage's parameters and buffers reach every rank; the ones this stage does not own are
        materialized on ``device`` (the host by default: Lightning moves the module there at teardown,
        and a model split for memory may not fit one device). Undone by :meth:`release_foreign_state`.
        """
        if self.num_stages == 1:  # the one stage holds everything already
            return
        owned = self._owned_tensors(named_state(self.root))
        parts: list[Any] = [None] * self.num_stages
        dist.all_gather_object(parts, to_wire(owned), group=self.group)
        foreign = {
            name: value for part in map(from_wire, parts) for name, value in part.items() if name not in owned
        }
        materialize_state(self.root, foreign, torch.device(device))
        self.foreign_layers.clear()

    def restore_full_optimizer_state(self, optimizers: Sequence[Optimizer]) -> None:
        """Give every rank's optimizers the whole state again, as one process would hold it (collective;
        after :meth:`restore_full_model`, whose parameters the state is keyed by). Each stage holds the
        state of its own parameters only; without this ``trainer.optimizers[0].state_dict()`` after a fit
        lacked the other stages' moments, and a second fit of the same object restarted them."""
        if self.num_stages == 1:  # the one stage holds everything already
            return
        for optimizer in optimizers:
            local = optimizer.state_dict()
            parts: list[Any] = [None] * self.num_stages
            dist.all_gather_object(parts, to_wire(_host_states(local)), group=self.group)
            optimizer.load_state_dict(_merged_states(map(from_wire, parts), local))

    def set_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """The optimizers over the whole model; state of parameters elsewhere is dropped."""
        self.optimizers = list(optimizers)
        self.release_foreign_state()

    # ------------------------------------------------------------------ steps
    def times_micro_batch(self, micro: int, num_micro: int) -> bool:
        """Whether training micro-batch ``micro`` of the coming step records per-layer times.

        Timing costs a gradient hook per cluster and a clock mark per node (CUDA events on a GPU, read
        once the device has passed them), so it runs only where a decision reads it (``"auto"``):
        while ``partition="time"`` profiles, before the first memory plan, and with rebalancing on.
        Then the first ``FULLY_TIMED_MICRO_BATCHES`` micro-batches (at the start and after a check
        that moved layers) are all timed and afterwards one per timed step, its position rotating
        through the step, which keeps the means representative at a fraction of the cost; a check that
        moved nothing keeps the times, aged (``TIMES_KEPT_AFTER_A_QUIET_CHECK``), instead of timing
        afresh. Every step is a timed step while a profile reads the times; with rebalancing alone,
        every ``interval // TIMED_STEPS_PER_CHECK``-th step is (about 16 per check interval; every step
        for intervals under 32 steps). ``layer_timing="sampled"`` times one micro-batch per step even
        when nothing reads the times, ``"all"`` every micro-batch, ``"off"`` none.
        """
        mode = self.layer_timing
        if mode not in LAYER_TIMING_MODES:
            raise ValueError(f"layer_timing={mode!r} is not one of {list(LAYER_TIMING_MODES)}.")
        if mode == "off" or (mode == "auto" and not self._times_needed()):
            return False
        if mode == "all" or self.executor.timed_forwards < FULLY_TIMED_MICRO_BATCHES:
            return True
        stride = self._timing_stride() if mode == "auto" else 1
        if self.steps % stride:
            return False
        return micro == (self.steps // stride) % num_micro

    def _timing_stride(self) -> int:
        """Every how many steps one micro-batch is timed after the first ones (``times_micro_batch``)."""
        settings = self.settings
        interval = self.steps_per_check
        if settings.rebalance not in ("epoch", "never"):
            interval = int(settings.rebalance)
        if self._profiling() or not interval:
            return 1
        return max(1, interval // TIMED_STEPS_PER_CHECK)

    def _times_needed(self) -> bool:
        return self.settings.rebalance != "never" or self._profiling()

    def _profiling(self) -> bool:
        """Whether a profile reads the layer times: ``partition="time"`` before its split, or the memory
        plan's first ``profile_steps``."""
        settings = self.settings
        return (settings.partition == "time" and not self._time_split_done) or (
            settings.memory_limit is not None and self.steps < settings.profile_steps
        )

    def train_step(self, num_micro: int, forward: Any, keys: Sequence[Hashable] | None = None) -> None:
        """One step's micro-batches through this stage; ``keys`` see :meth:`PipelineSchedule.train_step`."""
        # a memory policy stashes activations its own way (swap, recompute): no split backward with it
        self.schedule.split_backward = self.executor.layer_run is None
        armed = self._arm_replica_average(num_micro)
        try:
            self.schedule.train_step(num_micro, forward, keys)
        finally:
            if armed:
                assert self.replica_gradients is not None
                self.replica_gradients.disarm()
        if armed:
            self.replica_gradients.flush()  # type: ignore[union-attr]
        self.executor.resolve(wait=False)  # on a GPU: what the device has finished, without waiting
        self.steps += 1

    def eval_step(self, num_micro: int, forward: Any, keys: Sequence[Hashable] | None = None) -> list[Any]:
        return self.schedule.eval_step(num_micro, forward, keys)

    # ------------------------------------------------------------------ rebalancing
    def local_times(self) -> dict[str, Any]:
        """This stage's measurements since the last check: layer times, exit and activation bytes."""
        self.executor.resolve()
        times = self.executor.times
        self._refresh_kept_bytes()
        names = {i: self.graph.layers[i].name for i in self.executor.layer_range}
        return {
            "layers": times.summary(self.executor.layer_range),
            "exit_bytes": {c: times.exit_bytes[c] for c in self.executor.cluster_range},
            "input_bytes": {i: times.input_bytes[i] for i in self.executor.layer_range},
            "saved_bytes": {i: self._kept_bytes[n] for i, n in names.items() if n in self._kept_bytes},
        }

    def rebalance(
        self, threshold: float, tolerance: float = 0.02, force: bool = False, min_gain: float = 0.05
    ) -> RebalanceDecision:
        """Gather every stage's per-layer times on every stage, decide (each stage alike, from the same
        table), migrate (collective)."""
        gathered = self._gather_times()
        self.layer_table = gathered.table
        decision = decide_rebalance(
            self.graph,
            self.partition,
            gathered.table["layers"],
            gathered.exit_bytes,
            threshold,
            tolerance,
            force,
            min_gain,
        )
        self.last_decision = decision
        self.checks.append(
            {
                "step": self.steps,
                "reason": decision.reason,
                "changed": decision.new is not None,
                "stage_times": list(decision.stage_times),
                "extra_warmup": self._choose_extra_warmup(decision.new or self.partition, gathered.memory),
            }
        )
        if decision.new is None:
            self.executor.age_times(TIMES_KEPT_AFTER_A_QUIET_CHECK)
            return decision
        self.executor.reset_times()
        event = RebalanceEvent(self.steps, decision)
        report = self.apply_partition(decision.new)
        reports = self._gather_on_last(report.to_dict())
        if self.is_last:
            event.migration = reports
            event.pause_seconds = max(r["seconds"] for r in reports)
        self.history.append(event)
        log.info(
            "hier_pipeline: stage times %s -> predicted %s; partition %s -> %s; pause %.3fs",
            [round(t, 4) for t in decision.stage_times],
            [round(t, 4) for t in decision.predicted_times],
            decision.old,
            decision.new,
            event.pause_seconds,
        )
        return decision

    def _gather_times(self) -> GatheredTimes:
        """Every stage's :meth:`local_times` and device memory on every stage, in one collective of fixed-size
        host rows (pipeline/time_table.py)."""
        num_layers, num_clusters = len(self.graph.layers), self.graph.num_clusters
        memory = (0, 0)
        if self.device.type == "cuda":
            capacity = torch.cuda.get_device_properties(self.device).total_memory
            memory = (torch.cuda.max_memory_allocated(self.device), capacity)
        row = pack_stage_times(self.local_times(), num_layers, num_clusters, memory)
        rows = [row]
        if self.num_stages > 1:
            rows = [torch.empty_like(row) for _ in range(self.num_stages)]
            dist.all_gather(rows, row, group=self.group)
        if self.replica_group is not None:
            # every replica's table, averaged (each device's peak: the largest), so that every replica
            # decides the same split from the same numbers and they migrate alike
            table = averaged_over_replicas(
                torch.stack(rows), self.replica_group, self.layout.replicas, max_columns=_DEVICE_COLUMNS
            )
            rows = list(table.unbind(0))
        return merge_stage_times(rows, num_layers, num_clusters)

    def _choose_extra_warmup(self, partition: StagePartition, memory: Sequence[tuple[int, int]]) -> list[int]:
        """``extra_warmup="auto"``: the extra 1F1B warm-up forwards per stage that shorten the step simulated
        from the measured layer times on ``partition`` (pipeline/warmup.py). Every stage decides from the
        same gathered table, so all agree. Not under a ``memory_limit`` (each extra forward holds one
        more micro-batch's activations, which the memory plan does not trade against time) nor GPipe."""
        settings = self.settings
        if (
            settings.extra_warmup != "auto"
            or settings.memory_limit is not None
            or self.schedule.kind != "1f1b"
        ):
            return list(self.schedule.extra_warmup)
        layers = self.layer_table["layers"]
        # per stage, its layers' forward and backward apart (the rebalancer's sums add the two)
        only_forward = {i: (f, 0.0) for i, (f, _) in layers.items()}
        only_backward = {i: (b, 0.0) for i, (_, b) in layers.items()}
        forward = stage_costs(partition, cluster_costs(self.graph, only_forward))
        backward = stage_costs(partition, cluster_costs(self.graph, only_backward))
        extra = [0] * (self.num_stages - 1)
        if all(t > 0 for t in forward) and all(t > 0 for t in backward):  # the same on every stage
            fits = self._memory_fits(memory)
            extra = choose_extra_warmup(forward, backward, settings.micro_batches, fits=fits)[:-1]
        if extra != self.schedule.extra_warmup:
            log.info(
                "hier_pipeline: extra warm-up forwards per stage %s -> %s", self.schedule.extra_warmup, extra
            )
        self.schedule.extra_warmup = extra
        return list(extra)

    def _memory_fits(self, memory: Sequence[tuple[int, int]]) -> Callable[[list[int]], bool] | None:
        """On a GPU: whether warm-up counts leave every stage's peak memory within its device (each stage's
        peak so far, scaled by the micro-batches it would hold; ``memory``: (peak, capacity) per rank, as
        gathered with the times, so every stage decides alike). ``None`` on the host, where the counts are
        not limited by memory."""
        if self.device.type != "cuda":
            return None
        by_stage = [memory[self.layout.position(stage)] for stage in range(self.num_stages)]
        peaks, capacities = zip(*by_stage)
        current = self.schedule.warmups(self.settings.micro_batches)
        return lambda counts: fits_in_memory(peaks, capacities, current, counts)

    def after_optimizer_step(self, steps: int, epoch_ends: bool) -> None:
        """The plans that follow optimizer step number ``steps`` (1-based; ``epoch_ends`` when it was the
        epoch's last): the one split by measured times (``partition="time"``, once ``profile_steps`` have
        run), the memory plan when due, and a rebalance check when ``rebalance`` says one is due
        (``"epoch"``: at the epoch's end; ``N``: every N steps). Collective: every stage calls it."""
        settings = self.settings
        if settings.partition == "time" and not self._time_split_done and steps >= settings.profile_steps:
            self._time_split_done = True
            self.rebalance(settings.imbalance_threshold, settings.balance_tolerance, force=True)
            self.decide_memory_plan()
            return
        if self.memory_plan_due(steps):
            self.decide_memory_plan()
        if settings.rebalance == "never":
            return
        due = epoch_ends if settings.rebalance == "epoch" else steps % int(settings.rebalance) == 0
        if due:
            decision = self.rebalance(
                settings.imbalance_threshold, settings.balance_tolerance, min_gain=settings.min_rebalance_gain
            )
            # a new split re-decides every stage's plan; otherwise only where memory changed
            self.decide_memory_plan(force=decision.new is not None)

    def apply_partition(self, new: StagePartition) -> MigrationReport:
        """Move layers live so that ``new`` holds (collective over all stages)."""
        moves = plan_moves(self.graph, self.partition, new)
        report = migrate(
            moves, self.stage, self._rank_of_stage, self.root, self.optimizers, self.device, self.group
        )
        # what this stage sent away, and a replica whose layers here all left (it moved nowhere), once
        # every move has run: a tensor tied across layers may leave this stage for several others
        kept = set(self.owned_state_names(new))
        release_state(self.root, [n for n in self.owned_state_names() if n not in kept], self.optimizers)
        self.partition = new
        self.foreign_layers.refresh(self._foreign_state_names())
        self._find_tied()
        self.executor.set_partition(new)
        self._watch_weight_grads()
        self.link.forget_specs()  # the cuts moved
        self._apply_fixed_policy()
        return report

    def adopt_partition(self, new: StagePartition, full_state: dict[str, torch.Tensor]) -> None:
        """Switch to ``new`` using a full state dict every rank holds (checkpoint resume)."""
        owned = set(self.owned_state_names(new))
        current = set(self.owned_state_names())
        state = named_state(self.root)
        release_state(self.root, [n for n in current - owned if n in state], self.optimizers)
        materialize_state(
            self.root, {n: full_state[n] for n in owned - current if n in full_state}, self.device
        )
        self.partition = new
        self.foreign_layers.refresh(self._foreign_state_names())
        self._find_tied()
        self.executor.set_partition(new)
        self._watch_weight_grads()
        self.link.forget_specs()  # the cuts moved
        self._apply_fixed_policy()

    # ------------------------------------------------------------------ checkpoints
    def _owned_tensors(self, state: dict[str, Any]) -> dict[str, torch.Tensor]:
        owned = set(self.owned_state_names())
        return {k: v.detach().cpu() for k, v in state.items() if k in owned}

    def consolidated_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The module's full ``state_dict`` on the last stage (rank 0); others get their share."""
        mine = self._owned_tensors(state_dict)
        gathered = self._gather_on_last(mine)
        if not self.is_last:
            return mine
        merged: dict[str, Any] = {}
        for part in gathered:
            merged.update(part)
        return {k: merged.get(k, v) for k, v in state_dict.items()}

    def consolidated_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """``optimizer.state_dict()`` as one process training the whole model would write it."""
        local = optimizer.state_dict()
        gathered = self._gather_on_last(_host_states(local))
        if not self.is_last:
            return local
        return _merged_states(gathered, local)

    def drop_foreign_optimizer_state(self) -> None:
        """After loading a full optimizer state dict: keep only this stage's parameters' state."""
        owned = set(self.owned_state_names())
        for name, param in self.root.named_parameters(remove_duplicate=False):
            if name not in owned:
                for opt in self.optimizers:
                    opt.state.pop(param, None)

    def checkpoint_meta(self) -> dict[str, Any]:
        """What a checkpoint records besides the consolidated states: the split and its basis."""
        return {
            "partition": self.partition.to_dict(),
            "num_stages": self.num_stages,
            "replicas": self.layout.replicas,
            "layers": [layer.name for layer in self.graph.layers],
            "history": [event.to_dict() for event in self.history],
        }

    def load_full_state(
        self, state_dict: dict[str, Any], meta: dict[str, Any] | None, strict: bool = True
    ) -> None:
        """Resume from a consolidated state dict; keep the saved split if it fits this run."""
        if meta is not None:
            saved = StagePartition.from_dict(meta["partition"])
            same_model = meta.get("layers") == [layer.name for layer in self.graph.layers]
            if saved.num_stages == self.num_stages and same_model and saved != self.partition:
                self.adopt_partition(saved, state_dict)
            elif saved.num_stages != self.num_stages:
                log.info(
                    "hier_pipeline: checkpoint has %d stages, this run %d; keeping %s",
                    saved.num_stages,
                    self.num_stages,
                    self.partition,
                )
        state = named_state(self.root)
        owned = self.owned_state_names()
        expected = set(self.root.state_dict().keys())
        if strict:
            missing = sorted(expected - set(state_dict))
            unexpected = sorted(set(state_dict) - expected)
            if missing or unexpected:
                raise RuntimeError(
                    f"checkpoint state_dict does not match the model: missing {missing}, "
                    f"unexpected {unexpected}"
                )
        with torch.no_grad():
            for name in owned:
                if name in state_dict and name in expected:
                    value = state_dict[name]
                    if state[name].shape != value.shape:
                        raise RuntimeError(
                            f"checkpoint tensor {name} has shape {tuple(value.shape)}, "
                            f"the model {tuple(state[name].shape)}."
                        )
                    state[name].copy_(value)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient (summed over stages, a parameter tied across
        stages counted once, on the first of them); returns that norm. The stage's part is taken with
        torch's multi-tensor kernels (``_foreach_norm`` / ``_foreach_mul_``, as ``clip_grad_norm_`` does):
        one launch per group of tensors instead of several per parameter, which on a GPU is host time."""
        counted_elsewhere = {id(self._params[t.name]) for t in self.tied if t.stages[0] != self.stage}
        with_grad = [p for p in self.root.parameters() if p.grad is not None and p.numel() > 0]
        grads = [p.grad for p in with_grad]
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        counted = [p.grad.detach() for p in with_grad if id(p) not in counted_elsewhere]
        for same in _by_dtype(counted).values():
            local += torch.stack(torch._foreach_norm(same)).double().pow(2).sum()
        dist.all_reduce(local, group=self.group)
        total = local.sqrt()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for dtype, same in _by_dtype(grads).items():
            torch._foreach_mul_(same, coef.to(dtype))
        return total

    # ------------------------------------------------------------------ memory policy
    @property
    def _fixed_policy(self) -> str | None:
        policy = self.settings.activation_policy
        return None if policy == "auto" else policy

    def _enable_memory_policy(self) -> None:
        """With a ``memory_limit`` (or a fixed ``activation_policy``) every layer runs through the
        runner, which measures what it stashes."""
        if self.settings.memory_limit is None and self._fixed_policy is None:
            return
        self.meter = ActivationMeter()
        self.runner = LayerRunner(self.meter, self.device)
        self.schedule.meter = self.meter
        self.executor.layer_run = self.runner
        self.executor.layer_run_always = True
        self._apply_fixed_policy()

    def _apply_fixed_policy(self) -> None:
        """``activation_policy="swap"|"recompute"|"keep"``: the same policy for every layer here."""
        policy = self._fixed_policy
        if policy is not None:
            self.executor.policies = {self.graph.layers[i].name: policy for i in self.executor.layer_range}

    def memory_plan_due(self, steps: int) -> bool:
        """The first plan after ``profile_steps`` steps; afterwards at every rebalance check."""
        return self.settings.memory_limit is not None and steps == self.settings.profile_steps

    def base_bytes(self) -> int:
        """Parameters, gradients and optimizer state of this stage (they count against the limit)."""
        state = named_state(self.root)
        owned = {id(state[n]) for n in self.owned_state_names() if n in state}
        total = 0
        params = []
        for tensor in state.values():
            if id(tensor) not in owned:
                continue
            owned.discard(id(tensor))
            total += tensor.numel() * tensor.element_size()
            if isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad:
                total += tensor.numel() * tensor.element_size()  # its gradient
                params.append(tensor)
        # this stage's parameters' state only (after a fit every rank's optimizer holds the whole state)
        for opt in self.optimizers:
            for param in params:
                per_param = opt.state.get(param, {})
                total += sum(v.numel() * v.element_size() for v in per_param.values() if torch.is_tensor(v))
        return total

    def swap_bandwidth(self) -> float:
        """Host-link bytes/s: the setting, else a one-off timed device-to-host copy of 32 MiB."""
        if self.settings.swap_bandwidth is not None:
            return float(self.settings.swap_bandwidth)
        if self._measured_bandwidth is None:
            self._measured_bandwidth = measure_host_bandwidth(self.device)
        return self._measured_bandwidth

    def _refresh_kept_bytes(self) -> None:
        """Bytes each layer stashes when kept: measured under keep or swap (recompute hides them)."""
        if self.meter is None:
            return
        for i in self.executor.layer_range:
            name = self.graph.layers[i].name
            policy = self.executor.policies.get(name, KEEP)
            if policy == KEEP and name in self.meter.layer_bytes:
                self._kept_bytes[name] = self.meter.layer_bytes[name]
            elif policy == SWAP and name in self.meter.layer_host_bytes:
                self._kept_bytes[name] = self.meter.layer_host_bytes[name]

    def layer_memory_stats(self) -> list[LayerMemoryStats]:
        """This stage's layers as the memory policy sees them (per micro-batch, as if kept).

        Layers measured here since the last check use this stage's figures; layers that just
        migrated in use the figures their previous stage sent with the rebalance decision.
        """
        self._refresh_kept_bytes()
        self.executor.resolve()
        times = self.executor.times
        table = self.layer_table
        stats = []
        for i in self.executor.layer_range:
            name = self.graph.layers[i].name
            if times.forward_count[i] > 0:
                forward, backward = times.mean_forward(i), times.mean_backward(i)
                input_bytes = times.input_bytes[i]
            else:
                forward, backward = table["layers"].get(i, (0.0, 0.0))
                input_bytes = table["input_bytes"].get(i, 0)
            saved = self._kept_bytes.get(name, table["saved_bytes"].get(i, 0))
            stats.append(LayerMemoryStats(name, saved, input_bytes, forward, backward))
        return stats

    def measured_peak_bytes(self) -> int:
        """Base bytes plus the peak of stashed activations (with the received inputs and outputs
        the schedule holds) measured since the last plan."""
        return self.base_bytes() + (self.meter.peak_bytes if self.meter is not None else 0)

    def decide_memory_plan(self, force: bool = True) -> MemoryPlan | None:
        """Each stage picks keep / swap / recompute per layer (collective: errors end every stage)."""
        limit = self.settings.memory_limit
        if limit is None or self.meter is None or self._fixed_policy is not None:
            return None
        error: tuple[str, int] | None = None
        plan = self.memory_plan
        deciding = self.replica_group is None or self.replica == 0
        if deciding and (force or needs_new_plan(plan, self.measured_peak_bytes(), limit)):
            try:
                plan = decide_memory_plan(
                    self.layer_memory_stats(),
                    in_flight=self.schedule.in_flight_limit(self.settings.micro_batches),
                    memory_limit=limit,
                    swap_bandwidth=self.swap_bandwidth(),
                    base_bytes=self.base_bytes(),
                    held_bytes=self.schedule.held_bytes,
                    previous=plan,
                )
            except MemoryLimitError as exc:
                error = (f"stage {self.stage}: {exc}", exc.required_bytes)
        if self.replica_group is not None:
            # replica 0's stage decides for every replica of it: from their own times and host links the
            # replicas could choose apart, and the same stage would hold different memory in each
            plan, error = agree_with_replica_0((plan, error), self.layout, self.stage, self.replica_group)
        # with replicas, over every rank: a replica whose stage fails stops the others too (their
        # next gradient average would wait for it)
        group = self.group if self.replica_group is None else control_group()
        errors: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
        failed = [e for e in errors if e is not None]
        if failed:  # every stage raises, so none waits for the others in the next step
            raise MemoryLimitError(
                "; ".join(message for message, _ in failed),
                memory_limit=limit,
                required_bytes=max(required for _, required in failed),
            )
        assert plan is not None
        self.memory_plan = plan
        self.executor.policies = plan.as_mapping()
        self.meter.reset_peak()
        mine = {
            "stage": self.stage,
            "summary": str(plan),
            "counts": {p: plan.count(p) for p in (KEEP, SWAP, RECOMPUTE)},
            "estimated_peak_bytes": plan.estimated_peak_bytes,
        }
        plans = self._gather_on_last(mine)
        if self.is_last:
            self.memory_plans = plans
            self.memory_events.append({"step": self.steps, "plans": plans})
            if self.history and self.history[-1].step == self.steps:
                self.history[-1].memory_plans = plans
        log.info("hier_pipeline stage %d memory plan: %s", self.stage, plan)
        return plan


def measure_host_bandwidth(device: torch.device, nbytes: int = 32 << 20) -> float:
    """Bytes per second of a device-to-host copy (pinned on CUDA), best of three."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pinned = device.type == "cuda"
    target = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    best = float("inf")
    for _ in range(3):
        if pinned:
            torch.cuda.synchronize(device)
        start = perf_counter()
        target.copy_(source, non_blocking=pinned)
        if pinned:
            torch.cuda.synchronize(device)
        best = min(best, perf_counter() - start)
    return nbytes / max(best, 1e-9)


def _by_dtype(tensors: Iterable[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    """``tensors`` grouped by dtype (a multi-tensor kernel takes one dtype)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return groups


def _host_states(state_dict: dict[str, Any]) -> dict[Any, dict[str, Any]]:
    """An optimizer ``state_dict``'s per-parameter states with their tensors on the host (to send)."""
    return {index: state_on_host(state) for index, state in state_dict["state"].items()}


def _merged_states(parts: Iterable[dict[Any, Any]], local: dict[str, Any]) -> dict[str, Any]:
    """Every stage's per-parameter states as one ``state_dict``, in parameter order (as one process
    training the whole model lists them), with ``local``'s param groups."""
    merged: dict[Any, Any] = {}
    for part in parts:
        merged.update(part)
    return {"state": dict(sorted(merged.items())), "param_groups": local["param_groups"]}
