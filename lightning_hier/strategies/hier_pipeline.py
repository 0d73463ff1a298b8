"""``strategy="hier_pipeline"``: pipeline stages rebalanced by live layer migration.

A thin adapter: Lightning's DDP machinery launches the processes and makes the default group;
:class:`lightning_hier.pipeline.engine.PipelineEngine` runs the stage. See ``docs/hier_pipeline.md``
for the contract a LightningModule follows.

Tuning attributes, automatic or off by default (not arguments); tests and benchmarks may set them on a
strategy before ``fit``, and each is validated as it is set (``ValueError`` naming it):

- ``_swap_bandwidth``: host-link bytes per second for the memory policy's swap cost; ``None`` (default)
  measures it with one timed device-to-host copy.
- ``_extra_warmup``: forwards a 1F1B stage runs before its first backward beyond ``stages - s``;
  ``"auto"`` (default) decides at each rebalance check from the measured layer times, an integer gives
  every stage but the last that many.
- ``_split_backward``: ``True`` computes each drain micro-batch's input gradient first and its weight
  gradients later (zero-bubble B/W split, ``pipeline/weight_grad.py``); experimental, off by default,
  never together with a memory policy.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.compile import to_uncompiled
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch.optim import Optimizer
from torch.utils.data import RandomSampler

from lightning_hier.pipeline.batch_agreement import stages_disagree
from lightning_hier.pipeline.batching import input_signature, split_batch
from lightning_hier.pipeline.delegation import as_forward
from lightning_hier.pipeline.engine import PipelineEngine
from lightning_hier.pipeline.graph import LayerGraph
from lightning_hier.pipeline.replicas import ReplicaLayout, build_groups
from lightning_hier.pipeline.settings import PipelineSettings, Rebalance, initial_partition
from lightning_hier.strategies.base import HierStrategy, ddp_arguments
from lightning_hier.strategies.callback_rules import refuse_unsupported_callbacks
from lightning_hier.strategies.instance_hooks import InstanceHooks
from lightning_hier.strategies.lightning_patches import (
    accumulating,
    attached_trainer,
    compiled_by_trainer,
    ddp_timeout,
    drop_layer_sync,
    install_global_norm_clipping,
    keep_users_sampler,
    layer_sync,
    optimizers_to_device,
    remove_global_norm_clipping,
    result_collection,
    step_values_over_micro_batches,
    training_step_loss,
    without_optimizer,
)
from lightning_hier.strategies.posted_broadcasts import PostedBroadcasts
from lightning_hier.strategies.sigterm_broadcast import SigtermBroadcast
from lightning_hier.strategies.stage_metrics_sync import StageMetricsSync
from lightning_hier.topology import all_ranks_group, control_group

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "hier_pipeline"


def _keep_metrics_local(module: torch.nn.Module) -> None:
    """torchmetrics objects would all-gather their state across every process at ``compute()``;
    only the last stage updates them, so that gather would wait forever. Keep them local."""
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return
    for sub in module.modules():
        if isinstance(sub, Metric):
            sub.sync_on_compute = False
            sub._to_sync = False


class _StageOutput(BaseException):
    """Ends the user's step on a non-last stage right after its ``forward`` (not an error)."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


@contextmanager
def _forward_replaced(
    module: torch.nn.Module, forward: Callable[..., Any], delegate: str | None = None
) -> Iterator[None]:
    """``self(...)`` runs ``forward`` during a step; so does ``self.<delegate>(...)``, the child the module's
    own ``forward`` only hands its inputs to (pipeline/delegation.py)."""
    module.forward = forward  # type: ignore[method-assign]
    child = module.get_submodule(delegate) if delegate is not None else None
    if child is not None:
        child.forward = as_forward(module, child, forward)  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.forward
        if child is not None:
            del child.forward


def _skip_zero_grad(*args: Any, **kwargs: Any) -> None:
    """Lightning's zeroing, skipped: the strategy zeroes before the schedule (a module-level function,
    not a lambda, so the strategy pickles for ``start_method="spawn"``)."""


class HierPipelineStrategy(HierStrategy):
    """Pipeline-parallel training whose stage split follows measured layer times.

    Each process holds one stage: a contiguous part of the LightningModule's traced ``forward``. Every
    step runs ``micro_batches`` micro-batches through the stages; the stages time their layers, and when
    they drift apart the layers that change stage migrate live with their parameters and optimizer state.
    With ``memory_limit`` each stage keeps, swaps to host or recomputes its stashed activations per layer.
    Guide: ``docs/hier_pipeline.md``.

    Args:
        micro_batches: micro-batches per step (the batch is split along dimension 0).
        schedule: ``"1f1b"`` (one forward, one backward; less activation memory) or ``"gpipe"``.
        partition: the initial split: ``"parameters"`` (balance parameter counts), ``"uniform"`` (equal
            layer counts), ``"time"`` (re-split from measured times after ``profile_steps``), clusters per
            stage (``[3, 5, 4]``) or the layer or module names where stages 1..K-1 begin.
        rebalance: when to re-split from measured times: ``"epoch"``, ``"never"``, every N optimizer steps,
            or a :class:`~lightning_hier.Rebalance` with the thresholds as well.
        memory_limit: bytes a stage may hold (parameters, gradients, optimizer state, stashed activations);
            ``None`` keeps every activation.
        profile_steps: steps measured before the ``partition="time"`` split and the first memory plan.
        leaf_modules: submodule names traced as one opaque layer (for code torch.fx cannot trace).
        activation_policy: ``"auto"`` (the memory policy, with ``memory_limit``), or ``"keep"``, ``"swap"``
            or ``"recompute"`` for every layer.
        static_shapes: ``True`` promises that what crosses a stage cut has the same shape and dtype whenever
            the micro-batch's tensors do; each cut's header is then sent once per shape. A stage seeing
            otherwise raises naming this option.
        split_tied_parameters: layers sharing a parameter (tied embeddings) may sit on different stages,
            each holding a replica whose gradients are summed; ``False`` keeps them on one stage.
        split_points: the modules where stages 1..K-1 begin (``["model.transformer.h.2"]``), checked before
            any process group exists; instead of ``partition``.
        stages: stages per pipeline; it must divide the processes (devices x num_nodes), which then run
            ``processes / stages`` data-parallel replicas of the pipeline, each reading its own shard of the
            data. ``None``: one pipeline over every process.

    The remaining arguments are ``DDPStrategy``'s. Tuning attributes (``_swap_bandwidth``,
    ``_extra_warmup``, ``_split_backward``) are described in this module's docstring.
    """

    _runtime_state = {
        "engine": lambda: None,
        "_metric_sync": lambda: None,
        "_loss_broadcasts": PostedBroadcasts,
        "_sigterm_broadcast": SigtermBroadcast,
    }

    strategy_name = "hier_pipeline"
    strategy_description = (
        "Pipeline stages rebalanced by live layer migration, with keep/swap/recompute per layer"
    )

    def __init__(
        self,
        micro_batches: int = 4,
        schedule: Literal["1f1b", "gpipe"] = "1f1b",
        partition: str | Sequence[int] | Sequence[str] = "parameters",
        rebalance: Literal["epoch", "never"] | int | Rebalance = "epoch",
        memory_limit: int | None = None,
        profile_steps: int = 3,
        leaf_modules: Sequence[str] = (),
        activation_policy: Literal["auto", "keep", "swap", "recompute"] = "auto",
        static_shapes: bool = False,
        split_tied_parameters: bool = True,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        *,
        split_points: Sequence[str] = (),
        stages: int | None = None,
    ) -> None:
        plan = Rebalance.of(rebalance)
        self.settings = PipelineSettings(
            stages=stages,
            micro_batches=micro_batches,
            schedule=schedule,
            partition=partition,
            rebalance=plan.every,
            imbalance_threshold=plan.imbalance_threshold,
            balance_tolerance=plan.balance_tolerance,
            min_rebalance_gain=plan.min_gain,
            memory_limit=memory_limit,
            profile_steps=profile_steps,
            leaf_modules=leaf_modules,  # checked and kept as a tuple by the settings
            activation_policy=activation_policy,
            static_shapes=static_shapes,
            split_tied_parameters=split_tied_parameters,
            split_points=split_points,
        )
        super().__init__(**ddp_arguments(locals()))
        self.engine: PipelineEngine | None = None
        # how the step's skip flag reaches the stages (see _skip_flag_on_host); None: by the device
        self.skip_flag_on_host: bool | None = None
        self._loss_broadcasts = PostedBroadcasts()  # the last stage's step losses and flags
        self._loss_receive: tuple[dist.Work, torch.Tensor] | None = None  # see _receive_loss_ahead
        self._sigterm_broadcast = SigtermBroadcast()
        self._hidden_example_input: tuple[pl.LightningModule, Any] | None = None  # set aside while running
        self._batch_checked_in_epoch: int | None = None  # the epoch whose first batch the stages compared
        self._user_zero_grad: Callable[..., Any] = _skip_zero_grad
        self._metric_sync: StageMetricsSync | None = None
        self._zero_grad_hook = InstanceHooks()

    # ------------------------------------------------------------------ tuning attributes (module docstring)
    @property
    def _swap_bandwidth(self) -> float | None:
        return self.settings.swap_bandwidth

    @_swap_bandwidth.setter
    def _swap_bandwidth(self, value: float | None) -> None:
        self.settings = dataclasses.replace(self.settings, swap_bandwidth=value)

    @property
    def _extra_warmup(self) -> int | str:
        return self.settings.extra_warmup

    @_extra_warmup.setter
    def _extra_warmup(self, value: int | Literal["auto"]) -> None:
        self.settings = dataclasses.replace(self.settings, extra_warmup=value)

    @property
    def _split_backward(self) -> bool:
        return self.settings.split_backward

    @_split_backward.setter
    def _split_backward(self, value: bool) -> None:
        self.settings = dataclasses.replace(self.settings, split_backward=value)

    # ------------------------------------------------------------------ environment
    def _validate_before_process_group(self) -> None:
        self.settings.check_world_size(self.planned_world_size)
        self.settings.check_split_points(self.planned_world_size, self.lightning_module)
        module = self.lightning_module
        refuse_unsupported_callbacks(module, "hier_pipeline")
        if module is not None and type(module).forward is pl.LightningModule.forward:
            raise ValueError(
                f"hier_pipeline splits the model's forward into stages, but {type(module).__name__} "
                "defines no forward(); define forward() and call self(...) in the *_step methods, or use "
                "hier_sliced, hier_bsp or ddp, which do not split the model."
            )
        if module is not None and compiled_by_trainer(module):
            # Lightning compiled the module's forward and *_step methods (a torch.compile'd module passed to
            # the Trainer); the steps call the stage's part of forward, which exchanges activations with
            # the neighbouring stages, and dynamo cannot trace that (inductor failed inside it)
            rank_zero_warn(
                "hier_pipeline runs a torch.compile'd LightningModule uncompiled: each process runs only its "
                "stage's part of forward and exchanges activations with the others in between, which a "
                "compile of the whole module cannot trace."
            )
            to_uncompiled(module)
        replicas = ReplicaLayout.of_world(self.planned_world_size, self.settings.stages).replicas
        if layer_sync(self) is not None and replicas > 1:
            # BatchNorm in a stage normalizes one micro-batch at a time (as in every micro-batched pipeline):
            # synchronizing it would take a collective per BatchNorm call between the replicas of a stage,
            # in the middle of the schedule's point-to-point traffic; refused rather than silently unsynced
            raise ValueError(
                f"sync_batchnorm=True with HierPipelineStrategy(stages={self.settings.stages}) on "
                f"{self.planned_world_size} processes ({replicas} replicas): BatchNorm is not synchronized "
                "across a pipeline's replicas; each stage's BatchNorm normalizes its own micro-batch. Leave "
                "sync_batchnorm off (every replica's running statistics are replica 0's where ddp's are rank "
                "0's: at validation, in checkpoints), or use hier_sliced or ddp for synchronized BatchNorm."
            )
        if layer_sync(self) is not None:
            rank_zero_warn(
                "sync_batchnorm=True with HierPipelineStrategy: a pipeline is one data-parallel replica, so "
                "there is nothing to synchronize; its BatchNorm layers stay as they are (each sees a "
                "micro-batch, as in every micro-batched pipeline)."
            )
            drop_layer_sync(self)
        trainer = attached_trainer(module)
        if trainer is not None and replicas == 1:  # Lightning attached it with the data
            # stages are not data-parallel replicas: each reads the user's loader as it is, where Lightning
            # would inject a (shuffling) DistributedSampler because the run is distributed. Before the user's
            # hooks run: configure_optimizers (or setup) reading trainer.estimated_stepping_batches loads the
            # train data there
            keep_users_sampler(trainer)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every stage of a replica reads the same batches (stage 0 needs the inputs, the last stage the
        # targets); each replica its own shard, as a ddp rank
        return {"num_replicas": self.layout.replicas, "rank": self.replica}

    def process_dataloader(self, dataloader: Any) -> Any:
        """Every stage must read the same batches in the same order.

        A shuffling ``RandomSampler`` without its own generator draws its order from the global
        RNG, which the stages consume differently (dropout on one stage, for instance); it gets a
        generator seeded from rank 0 here, so all stages draw the same permutation every epoch.
        """
        sampler = getattr(dataloader, "sampler", None)
        if isinstance(sampler, RandomSampler) and sampler.generator is None:
            seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)  # host control data: CPU backend
            if dist.is_initialized():
                dist.broadcast(seed, src=0, group=control_group())
            sampler.generator = torch.Generator().manual_seed(int(seed.item()))
        return dataloader

    def _take_over_zero_grad(self, module: pl.LightningModule) -> None:
        """Lightning zeroes gradients between ``training_step`` and ``backward``; the schedule's
        backward runs inside ``training_step``, so the strategy zeroes them before it instead."""
        self._zero_grad_hook.restore()
        self._user_zero_grad = module.optimizer_zero_grad  # the user's, also an instance attribute of theirs
        self._zero_grad_hook.wrap(module, "optimizer_zero_grad", skip=True)

    def _zero_grad(self, batch_idx: int) -> None:
        module = self.lightning_module
        assert module is not None
        trainer = module.trainer
        if batch_idx % max(int(trainer.accumulate_grad_batches), 1) != 0:
            return
        # on_before_zero_grad stays Lightning's to call (once per optimizer step, after training_step, as
        # under ddp); it reaches the skipped optimizer_zero_grad then (calling it here too would make two)
        for optimizer in self.optimizers:
            self._user_zero_grad(trainer.current_epoch, batch_idx, optimizer)

    @property
    def layout(self) -> ReplicaLayout:
        """Where each replica's stages run (``pipeline/replicas.py``)."""
        return ReplicaLayout.of_world(self.world_size, self.settings.stages)

    @property
    def num_stages(self) -> int:
        return self.layout.stages

    @property
    def stage(self) -> int:
        return self.layout.stage_of(self.global_rank)

    @property
    def replica(self) -> int:
        return self.layout.replica_of(self.global_rank)

    @property
    def _last_stage_rank(self) -> int:
        """The global rank of this replica's last stage (rank 0 in replica 0)."""
        return self.layout.rank(self.replica, self.num_stages - 1)

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        module = self.lightning_module
        assert module is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and not module.automatic_optimization:
            raise ValueError(
                "HierPipelineStrategy runs backward inside its schedule and needs automatic optimization; "
                "set `self.automatic_optimization = True`, or use strategy='hier_sliced' (manual "
                "optimization, several optimizers included) or 'ddp'."
            )
        plugin = self.precision_plugin
        if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
            raise ValueError(
                "HierPipelineStrategy does not support precision='16-mixed' (a loss scaler across stages); "
                "use '32-true' or 'bf16-mixed'."
            )
        self.precision_plugin.convert_module(self.model)
        self._failed = False
        self._loss_broadcasts.forget()
        self._loss_receive = None
        self._batch_checked_in_epoch = None
        if self.engine is not None and self.engine.root is not module:
            self.engine = None  # another module than the last run's: its own graph and split
        if self.engine is None:
            self._build_engine()
        else:
            self.engine.release_foreign_state()  # the last teardown gave this rank the whole model
        self._hide_example_input(module)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
            assert self.engine is not None
            self.engine.set_optimizers(self.optimizers)
            if self.engine.replica_buffers is not None:
                self.engine.replica_buffers.new_fit()
        self.setup_precision_plugin()
        if fitting:
            optimizers_to_device(self.optimizers, self.root_device)
            install_global_norm_clipping(self.precision_plugin, self)
        self._install_metric_sync(trainer)
        _keep_metrics_local(module)
        if fitting:
            self._take_over_zero_grad(module)
            self._sigterm_broadcast.install(trainer)
        self._restore_at_end_of_setup(trainer)  # the checkpoint's module and callbacks, before on_fit_start

    def _build_engine(self) -> None:
        module = self.lightning_module
        assert module is not None
        graph = LayerGraph(
            module,
            self.settings.leaf_modules,
            self.settings.split_tied_parameters,
            split_points=self.settings.split_points,
        )
        # the same on every rank (deterministic), so an error here is raised by all of them
        relays = graph.pad_with_relays(self.num_stages)
        if relays:
            rank_zero_warn(
                f"hier_pipeline: {type(module).__name__}.forward splits into only "
                f"{graph.num_clusters - relays} cluster(s) for {self.num_stages} stages, so {relays} "
                "stage(s) hold no layer and only relay the output: no speed-up over fewer devices. Split "
                "the forward into more layers (or use fewer devices) for a real pipeline."
            )
        decided: list[Any] = [None]
        if self.global_rank == 0:
            try:
                # the split, and the base seed of the layers' random streams (the same on every stage)
                decided = [(initial_partition(graph, self.settings, self.num_stages), torch.initial_seed())]
            except ValueError as exc:  # every stage raises it, none waits for the others
                decided = [str(exc)]
        # one replica: all ranks carry the stages' activations too (device and host tensors)
        dist.broadcast_object_list(decided, src=0, group=all_ranks_group(ddp_timeout(self)))
        if isinstance(decided[0], str):
            raise ValueError(decided[0])
        partition, rng_base = decided[0]
        layout = self.layout
        groups = build_groups(layout, self.global_rank, ddp_timeout(self))
        self.engine = PipelineEngine(
            graph,
            partition,
            self.stage,
            self.root_device,
            self.settings.schedule,
            self.settings,
            groups.pipeline,
            timeout=ddp_timeout(self),
            layout=layout,
            replica=self.replica,
            replica_group=groups.replicas,
        )
        self.engine.executor.rng_base = int(rng_base)
        log.info("hier_pipeline: %d clusters, partition %s", graph.num_clusters, partition)

    def _install_metric_sync(self, trainer: pl.Trainer) -> None:
        """The last stage's metrics on every stage (ModelCheckpoint, EarlyStopping and ReduceLROnPlateau
        read them everywhere), for this run only."""
        self._remove_metric_sync()
        module = self.lightning_module
        assert module is not None
        assert self.engine is not None
        self._metric_sync = StageMetricsSync(trainer, module, last_stage=self.engine.is_last)

    def _remove_metric_sync(self) -> None:
        if self._metric_sync is not None:
            self._metric_sync.remove()
            self._metric_sync = None

    def on_predict_start(self) -> None:
        if self._metric_sync is not None:
            self._metric_sync.on_predict_start()
        super().on_predict_start()

    def on_predict_end(self) -> None:
        if self._metric_sync is not None:
            self._metric_sync.on_predict_end()
        super().on_predict_end()

    # ------------------------------------------------------------------ steps
    def _step_forward(
        self,
        step_name: str,
        micro: list[tuple[Any, int]],
        total: int,
        args: tuple[Any, ...],
        scale: float,
        rng_step: int = 0,
    ) -> Callable[[int, torch.Tensor | None], Any]:
        """Per micro-batch: what this stage computes, calling the module's own ``*_step`` at the ends."""
        engine = self.engine
        module = self.lightning_module
        assert engine is not None and module is not None
        executor = engine.executor
        step_fn = getattr(module, step_name)
        self._losses: list[torch.Tensor] = []
        self._outputs: list[Any] = []
        self._skipped_micro_batches = 0
        self._extra: dict[str, Any] = {}

        delegate = engine.foreign_layers.delegate

        def run_user_step(m: int, forward: Callable[..., Any]) -> Any:
            with _forward_replaced(module, forward, delegate):
                return step_fn(micro[m][0], *args)

        training = step_name == "training_step"
        pulls_batches = is_param_in_hook_signature(step_fn, "dataloader_iter", explicit=True)

        def forward(m: int, received: torch.Tensor | None) -> Any:
            executor.rng_position = (rng_step, m)  # each layer's random stream (pipeline/layer_rng.py)
            # evaluation forwards (no graph) would bias the training layer times the decisions read
            executor.timing = training and engine.times_micro_batch(m, len(micro))
            # a middle stage runs the user's step too where the step pulls its own batch
            # (``dataloader_iter``), so every stage's iterator advances as the first and last stages' do,
            # and where its layers read a further input of forward (a padding mask) from the call
            if not engine.is_last and (engine.is_first or pulls_batches or executor.reads_inputs):

                def up_to_this_stage(*f_args: Any, **f_kwargs: Any) -> Any:
                    if engine.is_first:
                        raise _StageOutput(executor.forward(*f_args, **f_kwargs))
                    raise _StageOutput(executor.forward_received(received, f_args, f_kwargs))

                try:
                    run_user_step(m, up_to_this_stage)
                except _StageOutput as out:
                    return out.value
                raise RuntimeError(
                    f"{type(module).__name__}.{step_name} returned without calling self(...); under "
                    "hier_pipeline the step must run the model through its forward once."
                )
            if not engine.is_last:
                return executor.forward(received)

            def last_stage(*f_args: Any, **f_kwargs: Any) -> Any:
                if engine.is_first:
                    return executor.forward(*f_args, **f_kwargs)
                return executor.forward_received(received, f_args, f_kwargs)

            output = run_user_step(m, last_stage)
            if not training:
                self._outputs.append(output)
                return output
            # Lightning's own reading of a step's output: the same errors for invalid ones, and the
            # extra keys, which reach on_train_batch_end (the last micro-batch's)
            loss, self._extra = training_step_loss(output)
            if loss is None:
                # Lightning's "skip this batch": the micro-batch adds no gradient (the schedule sends
                # zeros back for an output that needs none); a step all of whose micro-batches skip
                # is skipped as a whole (see training_step)
                self._skipped_micro_batches += 1
                return torch.zeros((), device=self.root_device)
            weight = micro[m][1] / total
            self._losses.append(loss.detach() * weight)
            return loss * (weight * scale)

        return forward

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.engine is not None and self.lightning_module is not None
        batch, *rest = args
        trainer = self.lightning_module.trainer
        if self.num_stages > 1 and self._batch_checked_in_epoch != trainer.current_epoch:
            self._batch_checked_in_epoch = trainer.current_epoch
            self._check_every_stage_reads(batch, f"epoch {trainer.current_epoch}")
        micro, total = split_batch(batch, self.settings.micro_batches)
        self._zero_grad(int(rest[0]) if rest else trainer.fit_loop.epoch_loop.batch_idx)
        scale = 1.0 / max(int(trainer.accumulate_grad_batches), 1)
        # ddp's buffer broadcast and gradient sync: this batch's backward averages the gradients unless the
        # batch only accumulates them
        synchronises = not accumulating(trainer)
        self.engine.before_replica_forward(synchronises)
        self.engine.step_synchronises = synchronises
        with self.precision_plugin.train_step_context():
            # the batch's number in the whole fit (restored on resume): the layers' random streams
            rng_step = int(trainer.fit_loop.total_batch_idx)
            forward = self._step_forward("training_step", micro, total, tuple(rest), scale, rng_step)
            self.engine.schedule.loss_backward = self._loss_backward()
            # the loss's receive goes out once this stage's last message of the step is issued
            self.engine.schedule.after_messages = self._receive_loss_ahead
            # the user's step runs on the last stage only: its on_step values become the batch's
            with step_values_over_micro_batches(result_collection(trainer) if self.engine.is_last else None):
                self.engine.train_step(len(micro), forward, self._spec_keys("train", micro))
        loss = self._step_loss(len(micro))
        if loss is None:
            return None  # every stage skips the optimizer step, as Lightning does for one process
        loss = loss.to(torch.float64 if self.precision_plugin.precision == "64-true" else torch.float32)
        return {"loss": loss, **self._extra} if self._extra else loss

    def _check_every_stage_reads(self, batch: Any, where: str) -> None:
        """Refuse stages of a replica that read different batches (at the first batch of each epoch and of
        each validation or test loader, before the step's first layer): the pipeline would pair one sample's
        inputs with another's targets and go on silently. Compared over the replica's stages (host data:
        with one replica the control group, else the replica's group, which has a CPU backend)."""
        assert self.engine is not None
        group = control_group() if self.engine.replica_group is None else self.engine.group
        if stages_disagree(batch, group):
            raise RuntimeError(
                f"hier_pipeline: the stages read different batches ({where}'s first batch differs in "
                "its integer tensors, such as labels or token ids, or in its shapes). Stage 0 computes on "
                "a batch's inputs and the last stage on its targets, so every process must read the same "
                "batches. A loader that shards by rank (torch.distributed.get_rank(), webdataset's "
                "split_by_node) should shard by trainer.strategy.distributed_sampler_kwargs instead (the "
                "pipeline replica's num_replicas and rank), and random masks or labels drawn in a collate "
                "function should come from a generator seeded the same on every process."
            )

    def _step_loss(self, num_micro: int) -> torch.Tensor | None:
        """The step's loss on every stage (``None`` where every micro-batch skipped), from the last stage.

        float64 on every stage: only the last one knows the loss's dtype (float64 under "64-true"), and a
        broadcast whose ranks disagree on the dtype is a size mismatch.

        The last stage's ``trainer.should_stop`` travels with it: the user's ``training_step`` runs there
        only, so a step that stops the fit on its own condition (``if loss < x: self.trainer.should_stop
        = True``, as each ``ddp`` rank would decide for itself) stops every stage; otherwise the other stages
        would train on and the fit would hang."""
        assert self.engine is not None
        all_skipped = self._skipped_micro_batches == num_micro
        self._loss_broadcasts.wait()
        if self.num_stages == 1:  # this process is the last stage: no broadcast, no wait for the device
            return None if all_skipped else torch.stack(self._losses).sum().to(torch.float64)
        last = self._last_stage_rank
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        if self._skip_flag_on_host():
            # the flags on the group's host backend and the loss on the device: every stage reads the
            # flags without waiting for its own queued kernels (reading a device tensor's value would
            # drain the GPU's queue every step)
            flags = torch.tensor([float(all_skipped), float(trainer.should_stop)], dtype=torch.float64)
            self._broadcast_from_last(flags, last)
            trainer.should_stop = trainer.should_stop or bool(flags[1].item())
            if flags[0].item():
                return None
            loss = torch.zeros((), dtype=torch.float64, device=self.root_device)
            if self._losses:
                loss = torch.stack(self._losses).sum().to(torch.float64)
            self._broadcast_from_last(loss, last)
            return loss
        if self._loss_receive is not None:  # posted after this stage's last message (gloo)
            work, result = self._loss_receive
            self._loss_receive = None
            work.wait()
        else:
            result = torch.zeros(3, dtype=torch.float64, device=self.root_device)
            if self._losses:
                result[0] = torch.stack(self._losses).sum()
            result[1] = float(all_skipped)
            result[2] = float(trainer.should_stop)
            self._broadcast_from_last(result, last)
        skipped, stop = result[1:].tolist()
        trainer.should_stop = trainer.should_stop or bool(stop)
        return None if skipped else result[0]

    def _receive_loss_ahead(self) -> None:
        """On the host (gloo), a stage other than the last posts the receive of the step's loss and flags as
        soon as it has issued its last message of the step (the schedule calls this): on the first stage
        before its last backward, so the loss lands while that backward runs (posted after that backward,
        the receive waits for the last stage's communication thread: 0.35 ms per step on the first stage,
        whose last backward and next forward bound every step). Every stage issues it after all its
        point-to-point messages, as the last stage issues the broadcast after its own, so the ranks keep one
        issuing order of collectives (``tests/test_device_rule.py``); posted as the step begins it would be
        out of that order. Not on a GPU: there the loss travels on the device."""
        assert self.engine is not None
        if self.num_stages == 1 or self.engine.is_last or self._skip_flag_on_host():
            return
        result = torch.zeros(3, dtype=torch.float64, device=self.root_device)
        last = self._last_stage_rank
        work = dist.broadcast(result, src=last, group=self.engine.group, async_op=True)
        self._loss_receive = (work, result)

    def _broadcast_from_last(self, tensor: torch.Tensor, last: int) -> None:
        """Broadcast the step's loss or flags from the last stage. The other stages wait for the values;
        the last stage, which has them, goes on at once: waiting there (a gloo send completes once the
        receiver has posted its receive) put the other stages' last backward in front of its optimizer
        step, on the step's critical path. It waits at the next broadcast or at teardown."""
        assert self.engine is not None
        if self.engine.is_last:
            self._loss_broadcasts.post(tensor, last, self.engine.group)
        else:
            dist.broadcast(tensor, src=last, group=self.engine.group)

    def _skip_flag_on_host(self) -> bool:
        """Whether the step's skip flag travels apart from its loss, on the host backend: on a GPU (on
        the CPU one broadcast of both costs less); ``skip_flag_on_host`` set on the strategy decides
        otherwise (the tests take the GPU's path on CPU)."""
        forced = self.skip_flag_on_host
        return self.root_device.type == "cuda" if forced is None else bool(forced)

    def _loss_backward(self) -> Callable[[torch.Tensor], Any]:
        """How the last stage backpropagates a micro-batch's loss: through the LightningModule's
        ``backward`` where the user overrode it (as Lightning's precision plugin calls it), else
        autograd directly."""
        module = self.lightning_module
        if module is not None and is_overridden("backward", module, pl.LightningModule):
            return module.backward
        return torch.autograd.backward

    def _eval_step(self, step_name: str, context: Any, *args: Any) -> Any:
        assert self.engine is not None
        batch, *rest = args
        micro = [(batch, 0)]
        batch_idx = int(rest[0]) if rest and isinstance(rest[0], int) else 0
        if self.num_stages > 1 and batch_idx == 0 and step_name != "predict_step":
            # a validation or test loader's first batch: its metrics pair stage 0's inputs with the last
            # stage's targets too (predict has no targets)
            self._check_every_stage_reads(batch, f"the {step_name.split('_')[0]} run")
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        if step_name == "validation_step" and trainer.state.fn == TrainerFn.FITTING:
            # ddp's wrapper runs validation while fitting (not trainer.validate, test or predict)
            self.engine.before_replica_forward(synchronises=False)
        with context():
            forward = self._step_forward(step_name, micro, 1, tuple(rest), 1.0, rng_step=-1 - batch_idx)
            self.engine.eval_step(1, forward, self._spec_keys(step_name, micro))
        return self._outputs[0] if self._outputs else None

    def _spec_keys(self, kind: str, micro: list[tuple[Any, int]]) -> list[Hashable] | None:
        """Per micro-batch, what its cut specs are remembered under (``static_shapes``), else ``None``."""
        if not self.settings.static_shapes:
            return None
        return [(kind, input_signature(batch)) for batch, _ in micro]

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", self.precision_plugin.val_step_context, *args)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", self.precision_plugin.test_step_context, *args)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("predict_step", self.precision_plugin.predict_step_context, *args)

    def backward(
        self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Any:
        """The schedule already ran every micro-batch's backward inside ``training_step``; Lightning's
        backward hooks run here, on every stage, once per step as under DDP: ``on_before_backward``
        with the step's loss (after the micro-batches' backward passes, the first moment the whole
        loss exists) and ``on_after_backward`` with this stage's accumulated gradients."""
        module = self.lightning_module
        assert module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        return self.precision_plugin.post_backward(closure_loss, module)

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """A value logged with ``sync_dist=True``, reduced over the replicas of this rank's stage as ``ddp``
        reduces it over its ranks (default: the mean). Stages are not replicas: a value logged on the last
        stage is already the whole batch's, and only the last stage of each replica logs in a step, so with
        one replica the value comes back as it is, without a collective."""
        engine = self.engine
        if engine is None or engine.replica_group is None:
            return tensor
        return super().reduce(tensor, group=self._replicas_unless(group), reduce_op=reduce_op)

    def all_gather(
        self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> torch.Tensor:
        """``LightningModule.all_gather`` gathers over data-parallel replicas: over the replicas of this
        rank's stage (a leading dimension of their number, as under ``ddp``); with one replica the tensor
        comes back as Lightning returns it for one process (unchanged). A gather over the stage processes
        would wait forever in a step, which only the last stage runs."""
        engine = self.engine
        if engine is None or engine.replica_group is None:
            return tensor
        return super().all_gather(tensor, group=self._replicas_unless(group), sync_grads=sync_grads)

    def _replicas_unless(self, group: Any) -> Any:
        """The replicas of this rank's stage, for a reduction or gather over "every process" (``None``, or
        the default group, which ``LightningModule.all_gather`` passes); a group of the user's as it is."""
        assert self.engine is not None
        return self.engine.replica_group if group is None or group is dist.group.WORLD else group

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """The last stage (rank 0), which computes the loss and the metrics, decides for every stage.

        ``ModelCheckpoint`` (top-k) and ``EarlyStopping`` ask every rank; DDP sums the ranks'
        votes, which stages that are not replicas cannot give. A broadcast makes them agree.
        """
        if not dist.is_initialized() or self.world_size == 1:
            return decision
        flag = torch.tensor([int(bool(decision))], dtype=torch.int64)  # host control data: CPU backend
        dist.broadcast(flag, src=self.layout.rank(0, self.num_stages - 1), group=control_group())
        return bool(flag.item())

    def backward_pass_done(self) -> None:
        """Called by the precision plugin after the backward, before ``on_after_backward``: where the step
        started its replica average in the backward, wait for it, so that hook sees the averaged gradients
        as under ``ddp`` (and what it changes is what the optimizer reads)."""
        if self.engine is not None:
            self.engine.finish_replica_average()

    def before_optimizer_step_hooks(self) -> None:
        """Called by the precision plugin after the closure, before ``on_before_optimizer_step`` and
        clipping: each stage's gradients averaged over the pipeline's replicas, then the copies of a parameter
        tied across stages get the whole gradient."""
        if self.engine is not None:
            self.engine.average_replica_gradients()
            self.engine.sum_tied_gradients()

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._maybe_rebalance()
        return output

    def _maybe_rebalance(self) -> None:
        assert self.engine is not None and self.lightning_module is not None
        trainer = self.lightning_module.trainer
        loop = trainer.fit_loop.epoch_loop
        epoch_ends = loop.batch_progress.is_last_batch or loop.batch_idx + 1 >= trainer.num_training_batches
        # rebalance="epoch": a check per epoch's steps (an iterable loader without a length: unknown)
        batches = trainer.num_training_batches
        self.engine.steps_per_check = int(batches) if math.isfinite(batches) and batches > 0 else None
        # global_step is incremented after optimizer_step returns
        self.engine.after_optimizer_step(trainer.global_step + 1, epoch_ends)

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        state = self.lightning_module.state_dict()
        if self.engine is None:
            return state
        return self.engine.consolidated_state_dict(state)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self.engine is None or without_optimizer([optimizer]):  # no optimizer: Lightning's empty state
            return super().optimizer_state(optimizer)
        return self.engine.consolidated_optimizer_state(optimizer)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if self.engine is not None:
            checkpoint[CHECKPOINT_KEY] = self.engine.checkpoint_meta()
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        if self.engine is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        self.engine.load_full_state(checkpoint["state_dict"], checkpoint.get(CHECKPOINT_KEY), strict=strict)
        return None

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self.engine is not None:
            self.engine.drop_foreign_optimizer_state()
            optimizers_to_device(self.optimizers, self.root_device)

    def _hide_example_input(self, module: pl.LightningModule) -> None:
        """``example_input_array`` is set aside for the run: Lightning's model summary (every rank, at fit
        start) and a logger's graph run it through the whole model, which no process holds. Back at
        teardown."""
        if self.num_stages == 1 or module.example_input_array is None:
            return
        self._hidden_example_input = (module, module.example_input_array)
        module.example_input_array = None
        rank_zero_warn(
            f"hier_pipeline sets {type(module).__name__}.example_input_array aside while it runs: each "
            "process holds one stage's layers, so the example forward of the model summary (its In/Out "
            "sizes) and of a logger's graph cannot run. It is back after the run."
        )

    # ------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        """After a run every rank's module holds the whole trained model, as under ``ddp``, so the
        user's script can save, export or run it (and ``start_method="spawn"`` can hand it back), and
        after a fit every rank's optimizer holds the whole state, as ``ddp`` leaves it."""
        trainer = attached_trainer(self.lightning_module)
        if trainer is not None:
            self._sigterm_broadcast.remove(trainer, wait=not self._failed and dist.is_initialized())
        if self.engine is not None and not self._failed and dist.is_initialized():
            self._loss_broadcasts.wait()
            self.engine.restore_full_model("cpu")
            if self.optimizers and not without_optimizer(self.optimizers):
                self.engine.restore_full_optimizer_state(self.optimizers)
        if self._hidden_example_input is not None:
            module, example = self._hidden_example_input
            module.example_input_array, self._hidden_example_input = example, None
        remove_global_norm_clipping(self.precision_plugin)
        self._remove_metric_sync()
        self._zero_grad_hook.restore()
        super().teardown()
