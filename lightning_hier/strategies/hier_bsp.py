"""``HierBSPStrategy`` (``"hier_bsp"``): workers that never wait for each other, a BSP parameter server.

Lightning glue only: the worker loop, superstep control, server shards and shared-memory module are
:class:`lightning_hier.bsp.engine.BSPEngine`.

Tuning attributes, decided automatically (not arguments); tests and benchmarks may set them on a strategy
before ``fit``:

- ``_early_push``: in lockstep, push each gradient bucket of a worker's last micro-step of a superstep as
  soon as its gradients are in, while backward goes on (DDP's overlap, on the parameter server), instead of
  all after it. ``None`` (default): on with CUDA (and with ``bucketing="time"``), unless the LightningModule
  or a callback overrides ``on_after_backward`` or ``on_before_optimizer_step`` (a hook that changes
  gradients after backward would miss the buckets already pushed; a callback with
  ``leaves_gradients_alone = True``, such as ``CommProfiler``, does not count); off on CPU, where the
  pushes take the cores backward runs on. Ignored outside lockstep.
- ``_share_batches``: workers take the epoch's batches from one shared counter instead of a fixed
  ``1 / world_size`` each, so a faster worker trains on more of them and nobody idles at the epoch's end;
  the train loader is then unsized (no total in the progress bar, ``trainer.estimated_stepping_batches``
  is infinite; :mod:`lightning_hier.bsp.batch_claims`). ``None`` (default): on unless workers run in
  lockstep. Set in lockstep, the batches go to the workers in turn rather than by claims, so a superstep
  sums the same samples whatever the timing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from lightning_hier.bsp.batch_claims import ClaimingSampler, why_not_claimed
from lightning_hier.bsp.engine import BSPEngine
from lightning_hier.bsp.liveness import new_run_key
from lightning_hier.bsp.local_module import SuperstepRecord
from lightning_hier.bsp.settings import BSPSettings
from lightning_hier.bucketing.size_plan import BucketPlan
from lightning_hier.bucketing.time_bucketing import TimeBuckets, resolve_bucketing
from lightning_hier.bucketing.time_plan import TimePlan
from lightning_hier.checks import check_flag, check_megabytes, check_names
from lightning_hier.sliced.compressed_hop import inter_node_dtype_of
from lightning_hier.strategies.base import HierStrategy, ddp_arguments
from lightning_hier.strategies.callback_rules import refuse_unsupported_callbacks
from lightning_hier.strategies.lightning_patches import (
    accumulating,
    agree_after_epoch_end,
    attached_trainer,
    check_own_sigterm,
    current_hook,
    ddp_timeout,
    layer_sync,
    mark_train_data_loading,
    optimizers_to_device,
    restore_epoch_end,
    restore_sigterm_broadcast,
    restore_validation_check,
    route_gradient_clipping,
    route_zero_grad,
    run_closure,
    saves_by_steps_or_time,
    sync_module_states,
    train_data_loaded,
    unmark_train_data_loading,
    unroute_gradient_clipping,
    unroute_zero_grad,
    validate_at_every_epoch_end,
    with_train_sampler,
    without_optimizer,
)
from lightning_hier.topology import Topology, control_group, emulating_cuda, validate_layout

log = logging.getLogger(__name__)


class HierBSPStrategy(HierStrategy):
    """Data-parallel training where workers never wait for each other: a bulk-synchronous parameter server.

    Each worker trains on its own batches as fast as it can and folds its gradients into a local aggregate;
    a background thread pushes the aggregate to the parameter server (your optimizer, sharded over all
    ranks like ``hier_sliced``'s) at each superstep and pulls the new model. ``superstep=1,
    max_staleness=0`` is ``ddp``, step for step. See ``docs/hier_bsp.md``.

    Args:
        superstep: when a superstep closes: an ``int`` is a step count (the workers have folded that many
            optimizer steps each, on average); a duration, ``"500ms"``, ``"2s"``, ``"1.5min"`` or a
            ``datetime.timedelta``, is the time since it opened.
        max_staleness: no gradient is applied more than this many supersteps after the model it was
            computed from.
        devices_per_node: devices joined by the fast link (``None``: the processes per host). ``1``: every
            rank holds the whole server, one all-reduce per superstep (the faster layout on one host).
        bucket_cap_mb: size of one flat gradient bucket.
        log_supersteps: log each superstep's micro-steps, staleness, push/pull seconds and bytes (rank 0).
        elementwise_optimizers: class names of your optimizers whose update is elementwise, sharded like
            torch's ``SGD`` and ``Adam``.
        fill_idle: with ``max_staleness=0`` and a step count, a worker that would wait for a straggler
            computes up to this many more micro-steps from the same model.
        gradient_average: ``"folded"``: the server steps with the mean gradient per folded micro-step;
            ``"nominal"``: the sum over ``superstep x world_size``, weighed as that many ``ddp`` steps.
        bucketing: ``"size"``: buckets by ``bucket_cap_mb``. ``"time"`` or a
            :class:`~lightning_hier.TimeBuckets`, in lockstep: buckets planned from profiled
            gradient-ready times and pushed during backward (``docs/time_bucketing.md``).
        inter_node_dtype: the push across nodes in ``"bf16"`` or ``"fp16"`` (half the bytes), ``"int8"``
            (blocks of int8 with one fp32 scale each, about a quarter) or ``"fp8"`` (the same blocks of
            float8 e4m3 values), with error feedback, as ``hier_sliced``'s inter-node hop; ``None``: full
            precision.

    Outside lockstep (``max_staleness=0`` with a step count and no ``fill_idle``) workers take different
    numbers of steps: an epoch ends for everyone when the first worker runs out of batches, ``max_steps``
    counts the fastest worker's, and validation and checkpoints happen at epoch ends.

    The other arguments are ``DDPStrategy``'s. ``find_unused_parameters``, ``static_graph`` and
    ``gradient_as_bucket_view`` change nothing and warn when set.
    """

    _runtime_state = {"topology": lambda: None, "engine": lambda: None}

    strategy_name = "hier_bsp"
    strategy_description = (
        "Bulk-synchronous parameter server (sharded like hier_sliced) with asynchronous workers that fold "
        "gradients into a local aggregate"
    )
    ignored_ddp_reason = "a parameter without a gradient folds zeros."

    def __init__(
        self,
        superstep: int | str | timedelta = 4,
        max_staleness: int = 1,
        devices_per_node: int | None = None,
        bucket_cap_mb: float = 25.0,
        log_supersteps: bool = True,
        elementwise_optimizers: Sequence[str] = (),
        fill_idle: int = 0,
        gradient_average: Literal["folded", "nominal"] = "folded",
        bucketing: Literal["size", "time"] | TimeBuckets = "size",
        inter_node_dtype: Literal["bf16", "fp16", "int8", "fp8"] | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
    ) -> None:
        self.settings = BSPSettings(superstep, max_staleness, fill_idle, gradient_average)
        if devices_per_node is not None:
            validate_layout(devices_per_node, devices_per_node)
        check_megabytes("bucket_cap_mb", bucket_cap_mb)
        check_flag("log_supersteps", log_supersteps)
        elementwise_optimizers = check_names("elementwise_optimizers", elementwise_optimizers)
        mode, time_buckets = resolve_bucketing(bucketing, modes=("size", "time"))
        inter_node_dtype_of(inter_node_dtype)
        if mode == "time" and not self.settings.lockstep:
            raise ValueError(
                "bucketing='time' times the early push of plain BSP: it needs max_staleness=0 with a "
                f"superstep of a step count and no fill_idle, got {self.settings}."
            )
        super().__init__(**ddp_arguments(locals()))
        self.devices_per_node = devices_per_node
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.log_supersteps = log_supersteps
        self.elementwise_optimizers = tuple(elementwise_optimizers)
        self.bucketing = mode
        self.time_buckets = time_buckets
        self.inter_node_dtype = inter_node_dtype
        # tuning attributes (module docstring)
        self._early_push: bool | None = None
        self._share_batches: bool | None = None
        self.time_plan: TimePlan | None = None  # the plan the buckets were rebuilt from, once profiled
        self._earlier_records: list[SuperstepRecord] = []  # of engines replaced by a rebuild
        self._claiming = False  # the train loader now in use draws from a ClaimingSampler
        self._share_this_fit = self.share_batches  # off for a fit whose data loaded before setup
        self._loading_train_data = False
        self.topology: Topology | None = None
        self.engine: BSPEngine | None = None
        self._in_step = False
        # this optimizer step's backward passes: whether any ran, and whether the one completing it was
        # announced to the engine (by its start; a user's optimizer_step may run the closure itself
        # before calling optimizer.step(), which then hands the strategy an empty closure)
        self._backward_ran = False
        self._last_backward_announced = False
        self._logged = 0

    # ------------------------------------------------------------------ environment
    def _validate_before_process_group(self) -> None:
        Topology.from_world(self.planned_world_size, 0, self.devices_per_node, self.num_processes)
        module = self.lightning_module
        if module is None:
            return
        refuse_unsupported_callbacks(module, "hier_bsp", lockstep=self.settings.lockstep)
        trainer = attached_trainer(module)
        if layer_sync(self) is not None and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            raise ValueError(
                "sync_batchnorm=True with HierBSPStrategy: its workers compute without waiting for one "
                "another, so a BatchNorm that synchronizes every forward across processes cannot run there "
                "(it would pair different steps of different workers). Leave sync_batchnorm off: each "
                "worker's BatchNorm normalizes its own batch, and the running statistics are rank 0's on "
                "every rank at validation, checkpoints and the end of fit. Use hier_sliced or ddp for "
                "synchronized BatchNorm."
            )
        if not module.automatic_optimization:
            raise ValueError(
                "HierBSPStrategy supports automatic optimization only: the optimizer runs on the parameter "
                "server shards, not in your training_step. Set `self.automatic_optimization = True`, or use "
                "strategy='hier_sliced' (manual optimization, several optimizers included) or 'ddp'."
            )
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None:
            raise ValueError(
                "HierBSPStrategy does not support precision='16-mixed' (a loss scale per worker); use "
                "'bf16-mixed' or '32-true'."
            )
        if trainer is None or self.settings.lockstep:
            return
        mode = self._uneven_mode()
        lockstep = "use max_staleness=0 with a superstep of a step count and no fill_idle"
        # max_steps: workers run different numbers of steps; the first to reach it ends the fit for all
        # (optimizer_step), so it counts the fastest worker's steps
        # with validation off (limit_val_batches=0) no validation reads the interval: Lightning allows any
        by_steps = trainer.val_check_interval != 1.0 or trainer.check_val_every_n_epoch is None
        if by_steps and trainer.limit_val_batches != 0:
            raise ValueError(
                f"val_check_interval={trainer.val_check_interval!r} with HierBSPStrategy({mode}): validation "
                f"must run at epoch ends, where every worker has the same model (or {lockstep})."
            )
        for callback in trainer.callbacks:
            if isinstance(callback, ModelCheckpoint) and saves_by_steps_or_time(callback):
                raise ValueError(
                    f"ModelCheckpoint(every_n_train_steps/train_time_interval) with HierBSPStrategy({mode}): "
                    f"workers reach a step number at different times; save per epoch (every_n_epochs) or "
                    f"{lockstep}."
                )

    def _after_process_group(self) -> None:
        # every rank here, with the strategy's timeout: the host collectives between drains go over it,
        # and a default group without a CPU backend (process_group_backend="nccl") gets one beside it
        control_group(ddp_timeout(self))
        self.topology = Topology.from_world(
            self.planned_world_size, self.global_rank, self.devices_per_node, self.num_processes
        )
        self._warn_if_nodes_span_hosts(self.topology)

    def _uneven_mode(self) -> str:
        """The setting that lets workers take different numbers of steps, for error messages."""
        if self.settings.max_staleness > 0:
            return f"max_staleness={self.settings.max_staleness}"
        if self.settings.fill_idle:
            return f"fill_idle={self.settings.fill_idle}"
        return f"superstep={self.settings.superstep!r}"

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
        serving = fitting and not without_optimizer(self.optimizers)
        if serving:
            self._build_engine()
        else:
            if fitting and self.engine is not None:  # no optimizer: no server, parameters stay as they are
                self.engine.close()
                self.engine = None
            sync_module_states(self.model)
        self.setup_precision_plugin()
        if serving:
            optimizers_to_device(self.optimizers, self.root_device)
            self._route_to_engine()
            # workers run different numbers of steps and the BSP thread owns the training phase's
            # collectives: no per-step broadcast of rank 0's SIGTERM flag, each worker reads its own
            check_own_sigterm(trainer)
            mark_train_data_loading(trainer, self._note_train_data_loading)
            self._share_this_fit = self.share_batches
            if self.share_batches and train_data_loaded(trainer):
                self._keep_fixed_shards_for_an_early_estimate(trainer)
            if not self.settings.lockstep:
                validate_at_every_epoch_end(trainer, self._end_every_fit)
                agree_after_epoch_end(trainer, self._agree_on_stopping)
        self._restore_at_end_of_setup(trainer)  # the checkpoint's module and callbacks, before on_fit_start

    def _build_engine(self) -> None:
        assert self.topology is not None and self.lightning_module is not None
        if len(self.optimizers) != 1:
            raise ValueError(f"HierBSPStrategy needs exactly one optimizer, got {len(self.optimizers)}.")
        sync_module_states(self.lightning_module)  # every worker and every shard start from rank 0's model
        if self.engine is not None:
            self.engine.close()
        # the BSP thread's own groups (built once per process); its world carries host control rows,
        # counts and settings only, so gloo alone
        groups = self.topology.build_groups(ddp_timeout(self), dedicated="bsp", host_only=("world",))
        early_push = self._early_push_wanted()
        profile = None
        if self.bucketing == "time" and early_push:
            profile = (self.time_buckets.warmup_steps, self.time_buckets.profile_steps)
        elif self.bucketing == "time":
            rank_zero_warn(
                "HierBSPStrategy(bucketing='time') keeps size buckets: a hook that may change gradients "
                "after backward (on_after_backward or on_before_optimizer_step) rules out the early push "
                "that time buckets are for. A callback that only reads gradients can say so with a class "
                "attribute leaves_gradients_alone = True."
            )
        self._earlier_records, self.time_plan = [], None
        self.engine = self._new_engine(groups, early_push, profile=profile)

    def _new_engine(
        self,
        groups: Topology,
        early_push: bool,
        plan: BucketPlan | None = None,
        profile: tuple[int, int] | None = None,
    ) -> BSPEngine:
        assert self.lightning_module is not None
        timeout = ddp_timeout(self)
        timeout_s = timeout.total_seconds() if timeout is not None else 1800.0
        return BSPEngine(
            self.lightning_module,
            self.optimizers[0],
            groups,
            self.settings,
            bucket_cap_mb=self.bucket_cap_mb,
            timeout_s=timeout_s,
            elementwise_optimizers=self.elementwise_optimizers,
            early_push=early_push,
            plan=plan,
            profile=profile,
            inter_node_dtype=inter_node_dtype_of(self.inter_node_dtype),
        )

    def _rebuild_when_profiled(self) -> None:
        """Before an optimizer step's first micro-batch (in ``training_step``, or in ``optimizer_step``
        before the closure when that runs it): once profiled, replace the size-bucketed engine by one on
        the time plan, keeping the model and the optimizer state (every rank at the same micro-step:
        workers run in lockstep here). Parameters unfrozen or added to the optimizer since (Lightning's
        ``BaseFinetuning``) are taken in the same way: a new engine over them, on size buckets (profiled
        again under time bucketing)."""
        old = self.engine
        assert old is not None
        taking_in = old.has_new_parameters()
        if not old.wants_time_plan and not taking_in:
            return
        plan, profile, self.time_plan = None, old.profile, None
        if not taking_in:
            cap = int(self.bucket_cap_mb * 1024 * 1024)
            self.time_plan = old.time_plan(cap, int(self.time_buckets.min_bucket_mb * 1024 * 1024))
            plan, profile = self.time_plan.plan, None
        state = old.optimizer_state_dict()
        self._earlier_records += old.records
        old.close()
        self.engine = self._new_engine(old.topology, old.early_push, plan=plan, profile=profile)
        self.engine.take_over(state)
        self._route_to_engine()
        why = "parameters taken in" if taking_in else f"gradient-ready times: {self.time_plan.describe()}"
        log.info("hier_bsp: buckets rebuilt (%s)", why)

    @property
    def superstep_records(self) -> list[SuperstepRecord]:
        """Every superstep of this fit so far (also those before a time-plan rebuild)."""
        return self._earlier_records + (self.engine.records if self.engine is not None else [])

    @property
    def share_batches(self) -> bool:
        """Whether workers take the train batches from one shared counter (``_share_batches``, resolved)."""
        return not self.settings.lockstep if self._share_batches is None else bool(self._share_batches)

    def _early_push_wanted(self) -> bool:
        """``_early_push``, with ``None`` resolved: on CUDA, unless user code may change gradients after
        backward (a CPU run that builds its groups as on CUDA, for the device-rule audit, counts as CUDA)."""
        if self._early_push is not None:
            return self._early_push
        if self.root_device.type != "cuda" and not emulating_cuda() and self.bucketing != "time":
            return False
        module = self.lightning_module
        assert module is not None
        hooks = ("on_after_backward", "on_before_optimizer_step")
        trainer = attached_trainer(module)
        callbacks = trainer.callbacks if trainer is not None else []
        changes_gradients = any(is_overridden(hook, module) for hook in hooks) or any(
            getattr(type(callback), hook) is not getattr(pl.Callback, hook)
            for callback in callbacks
            if not getattr(callback, "leaves_gradients_alone", False)  # e.g. CommProfiler only reads the time
            for hook in hooks
        )
        return not changes_gradients

    def _route_to_engine(self) -> None:
        """Gradient zeroing and clipping go to the engine: the optimizer belongs to the server thread."""
        engine = self.engine
        assert engine is not None
        route_zero_grad(self, 0, lambda set_to_none=True: engine.zero_grad())
        route_gradient_clipping(
            self.precision_plugin, lambda algorithm, value: engine.set_clipping((algorithm, value))
        )

    # ------------------------------------------------------------------ data
    def _keep_fixed_shards_for_an_early_estimate(self, trainer: pl.Trainer) -> None:
        """The train data loaded before the strategy's setup: ``configure_optimizers`` (or ``setup``) read
        ``trainer.estimated_stepping_batches``, most often to size a schedule (OneCycleLR's ``total_steps``).
        That count is each worker's fixed share; with shared batches a faster worker takes more steps than
        it, and the schedule would run past its end (OneCycleLR raises). The workers keep their fixed shards
        for this fit instead, so no worker takes more steps than the estimate."""
        self._share_this_fit = False
        self._claiming = False
        estimate = trainer.estimated_stepping_batches
        rank_zero_warn(
            "HierBSPStrategy keeps each worker's fixed share of the train batches for this fit instead of "
            "sharing them: the train data was loaded before the strategy's setup, by reading "
            f"trainer.estimated_stepping_batches ({estimate}), and with shared batches "
            "a faster worker would take more steps than that estimate, running a schedule sized by it past "
            "its end. When the fastest workers finish their shares, a straggler's remaining batches of that "
            "epoch are skipped instead of taken over. To keep sharing, do not read the estimate before "
            "the fit starts (in configure_optimizers or setup)."
        )

    def _note_train_data_loading(self, loading: bool) -> None:
        """Lightning hands every loader to :meth:`process_dataloader` without saying which stage it is for;
        the fit loop's ``setup_data`` loads the train loaders only, and marks that window here."""
        self._loading_train_data = loading

    def process_dataloader(self, dataloader: object) -> object:
        """The train loader draws its batches from a :class:`ClaimingSampler` when batches are shared."""
        if not (self._loading_train_data and self._share_this_fit):
            return dataloader
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        why_not = why_not_claimed(dataloader)
        limit = trainer.limit_train_batches if trainer is not None else 1.0
        if why_not is None and isinstance(limit, float) and limit != 1.0:
            why_not = f"limit_train_batches={limit} needs a sized loader"
        step = self.lightning_module.training_step if self.lightning_module is not None else None
        if why_not is None and step is not None and is_param_in_hook_signature(step, "dataloader_iter", True):
            # such a step may fetch several batches; a worker whose claimed count is not a multiple of them
            # meets the end mid-step and returns None, which Lightning refuses on several processes
            why_not = "training_step takes the dataloader_iter (it may fetch several batches per step)"
        interval = trainer.val_check_interval if trainer is not None else 1.0
        if why_not is None and isinstance(interval, float) and interval != 1.0:
            # allowed off lockstep only where validation is off; Lightning still sizes it on the loader
            why_not = f"val_check_interval={interval} needs a sized loader"
        if why_not is not None:
            rank_zero_warn(
                "HierBSPStrategy keeps the train loader's fixed shards instead of sharing its batches: "
                f"{why_not}."
            )
            self._claiming = False
            return dataloader
        assert isinstance(dataloader, DataLoader)
        sampler = dataloader.sampler
        assert isinstance(sampler, DistributedSampler)
        claiming = ClaimingSampler.replacing(
            sampler,
            dataloader.batch_size or 1,
            dataloader.drop_last,
            f"{new_run_key()}/batches",
            in_turn=self.settings.lockstep,  # no claims in arrival order where no worker may take more
        )
        self._claiming = True
        return with_train_sampler(dataloader, claiming)

    # ------------------------------------------------------------------ step
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if self.engine is not None and not self._in_step:
            self._rebuild_when_profiled()
            self.engine.begin_step()  # the newest model, before this optimizer step's first forward
            self._in_step = True
        return super().training_step(*args, **kwargs)

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        # here rather than in an overridden backward: Lightning's Strategy.backward stays as it is
        if self.engine is not None:
            if not self._last_backward_announced and not self._accumulating():
                self._announce_last_backward()
            self._backward_ran = True
            self.engine.backward_starts()
        super().pre_backward(closure_loss)

    def _accumulating(self) -> bool:
        """Whether the running batch only accumulates gradients (Lightning steps the optimizer later).
        Where no fit runs the answer is yes: the backward is then announced in ``optimizer_step``, before
        its closure, and never one that only accumulates."""
        return accumulating(attached_trainer(self.lightning_module))

    def _announce_last_backward(self) -> None:
        assert self.engine is not None
        self.engine.expect_last_backward()  # this backward completes the micro-step
        self._last_backward_announced = True

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        if self.engine is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        model = model if model is not None else self.lightning_module
        assert isinstance(model, pl.LightningModule)
        # forward, backward and the hooks before the step; the step itself is the server's
        if not self._in_step:  # this optimizer step's first micro-batch runs inside the closure
            self._rebuild_when_profiled()
        if not self._last_backward_announced:
            self._announce_last_backward()  # the closure's backward (if it runs one) completes the micro-step
        result = run_closure(self.precision_plugin, model, optimizer, closure)
        if self._in_step:
            # computed: some backward of this step ran, inside the closure or before it (a user's
            # optimizer_step that calls the closure, then optimizer.step(); ddp steps on those gradients
            # too). A step whose every training_step returned None ran none and is skipped.
            self.engine.end_step(computed=self._backward_ran)
            self._in_step = self._backward_ran = self._last_backward_announced = False
        # the server's copy steps for this optimizer; torch's LR schedulers read this flag (set by the
        # step wrapper they install) to warn about a scheduler stepped before its optimizer
        optimizer._opt_called = True  # type: ignore[attr-defined]
        trainer = model.trainer
        progress = trainer.fit_loop.epoch_loop.batch_progress
        # global_step counts this step once optimizer_step returns; in lockstep every worker reaches
        # max_steps at the same step and Lightning ends the fit as under ddp (no extra epoch end)
        max_steps = -1 if self.settings.lockstep else trainer.max_steps
        reached_max_steps = max_steps not in (-1, None) and trainer.global_step + 1 >= max_steps
        if (
            progress.is_last_batch
            or reached_max_steps
            or self.engine.fit_should_end
            or (self.engine.epoch_should_end and not self._claiming)
        ):
            # another worker ran out of batches: this step ends the epoch here too (validation, epoch-end
            # schedulers and checkpoints follow as at any epoch's last batch); with shared batches every
            # worker runs out within a batch of the others by itself. A worker at max_steps ends the fit:
            # the others stop after the step they are in (the fastest worker sets the length).
            progress.is_last_batch = True
            self.engine.drain(epoch_end=True, fit_end=reached_max_steps)
            if self.engine.fit_should_end:
                trainer.should_stop = True
        else:
            self.engine.await_stepped_model()
        self._log_supersteps(trainer)
        return result

    def _end_every_fit(self) -> None:
        """This worker's fit stops (``trainer.should_stop``): the others stop after the step they are in.
        Nothing to do where this worker has drained already (an epoch's end, where every worker has)."""
        if self.engine is not None and not self.engine.memory.paused:
            self.engine.drain(epoch_end=True, fit_end=True)
            self._log_supersteps(self.lightning_module.trainer)  # those the drain closed

    def _agree_on_stopping(self, trainer: pl.Trainer) -> None:
        """At an epoch's end, after its hooks: the fit stops on every worker if it stops on one. A worker
        that set ``should_stop`` alone in its last batch of the epoch did so after every worker drained
        for the epoch's end, too late for :meth:`_end_every_fit`; without this the others began the next
        epoch and the fit hung. Every worker is drained here (the drain is a no-op where it is), so the
        decision is a real collective on every rank."""
        if self.engine is None:
            return
        self.engine.drain(rejoin=True)
        trainer.should_stop = self.reduce_boolean_decision(trainer.should_stop, all=False)
        self.engine.new_epoch()

    def _log_supersteps(self, trainer: pl.Trainer) -> None:
        assert self.engine is not None
        records = self.superstep_records
        if not (self.log_supersteps and self.is_global_zero and trainer.loggers):
            self._logged = len(records)
            return
        for number, record in enumerate(records[self._logged : len(records)], start=self._logged):
            metrics: dict[str, float] = {
                "bsp/staleness_max": record.max_staleness,
                "bsp/micro_steps": sum(record.micro_steps),
                "bsp/push_s": record.push_s,
                "bsp/step_s": record.step_s,
                "bsp/pull_s": record.pull_s,
                "bsp/push_bytes": record.push_bytes,
                "bsp/pull_bytes": record.pull_bytes,
                "bsp/early_buckets": record.early_buckets,
            }
            metrics.update({f"bsp/micro_steps_rank{r}": n for r, n in enumerate(record.micro_steps)})
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=number + 1)  # superstep numbers go on across a rebuild
            self._logged += 1

    def on_train_start(self) -> None:
        """The server starts from the module as training starts, after every restore hook and the
        callbacks' and module's ``on_train_start``, as ``ddp`` trains whatever the module then holds.
        ``WeightAveraging`` loads its ``current_model_state`` into the module directly, after
        :meth:`load_model_state_dict` gave the server the averaged weights; starting the server from the
        module here makes it train from the module's weights, as ``ddp`` does."""
        if self.engine is not None:
            self.engine.load_params()
            self.engine.new_epoch()

    def on_validation_start(self) -> None:
        if self.engine is not None:
            trainer = attached_trainer(self.lightning_module)
            # an epoch's validation while fitting: a worker without a micro-step in it drains with the rest
            fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
            self.engine.drain(rejoin=fitting and not trainer.sanity_checking)
            self._share_buffers()

    def on_train_end(self) -> None:
        if self.engine is not None:
            self.engine.drain(rejoin=True)
            self._share_buffers()

    def _share_buffers(self) -> None:
        """Rank 0's module buffers (BatchNorm's running statistics, ...) on every rank, after a drain.

        The server holds parameters only; each worker updates its buffers in its own forwards. ``ddp``
        broadcasts rank 0's buffers before every forward, so a model validated or saved has rank 0's
        everywhere; this does the same where they are read (validation, checkpoints, the end of fit),
        on the main thread while the workers are drained."""
        module = self.lightning_module
        if module is None or not dist.is_initialized() or self.world_size < 2:
            return
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)

    @property
    def _running_free(self) -> bool:
        """Between drains: workers are not in step, so a main-thread collective cannot pair them."""
        return self.engine is not None and not self.engine.memory.paused

    @property
    def _keeps_own(self) -> bool:
        """Workers not in lockstep, between drains or in a per-batch training hook: a main-thread collective
        cannot pair them, so values, decisions and barriers stay the worker's own. The hook counts as well
        as the pause: at an epoch's last batch a worker that knew it was last has drained in its optimizer
        step while one that claimed the last batch has not, and both must skip the same collectives."""
        if self.engine is None or self.settings.lockstep:
            return False
        module = self.lightning_module
        in_batch = module is not None and current_hook(module) in _PER_BATCH_HOOKS
        return in_batch or self._running_free

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        """While workers run free (between drains, not in lockstep) a collective would pair different steps
        of different workers: values logged with ``sync_dist=True`` then stay this worker's own. In lockstep
        they are reduced as under ddp: every worker takes the same steps, so the n-th collective of one
        worker's training steps pairs with the n-th of every other's. There, and for host tensors anywhere,
        the value is reduced on the host (:func:`_reduce_on_host`); device tensors while the workers are
        drained (validation, epoch ends, after fit) go over ddp's device collectives."""
        if self._keeps_own or not isinstance(tensor, torch.Tensor):
            return tensor
        if self._running_free or tensor.device.type == "cpu":
            return _reduce_on_host(tensor, group, reduce_op)
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        """Where workers keep their own values (:meth:`reduce`), a decision is the worker's own too: ddp's sum
        compared with the world size would read every worker's ``True`` as ``False`` under ``all=True``
        (``SpikeDetection`` would then never update its statistics). A worker that
        raises on its decision stops the others through the engine's abort."""
        if self._keeps_own:
            return bool(decision)
        return super().reduce_boolean_decision(decision, all=all)

    def barrier(self, name: str | None = None) -> None:
        """Where workers keep their own values a barrier would pair different steps (and wait for a step a
        peer never takes): it returns at once. Between drains in lockstep it meets on the host, over the
        control group (``lightning_hier.topology.control_group``), since the BSP thread issues the device's
        collectives (ddp's barrier on NCCL is a device collective)."""
        if self._keeps_own:
            return None
        if not self._running_free:
            return super().barrier(name)
        if self.world_size > 1 and dist.is_initialized():
            # a host tensor, so gloo: dist.barrier would go to the group's bound device on CUDA (which a
            # CPU run cannot show; its test counts dist.barrier calls instead)
            dist.all_reduce(torch.zeros(1), group=control_group())
        return None

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Where workers keep their own values the object stays the worker's own (a broadcast would pair
        different steps: Lightning's learning-rate finder broadcasts ``should_stop`` after every batch and
        hung there); between drains in lockstep it goes over the host, on the control group, beside the BSP
        thread's device collectives."""
        if self._keeps_own:
            return obj
        if not self._running_free or not dist.is_initialized():
            return super().broadcast(obj, src)
        objects = [obj]
        dist.broadcast_object_list(objects, src=src, group=control_group(), device=torch.device("cpu"))
        return objects[0]

    def all_gather(
        self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> torch.Tensor:
        """Between drains workers that are not in lockstep run free, so a gather would pair different steps
        of different workers (and, with ``max_staleness >= 1``, one worker's last gather would wait for a
        step its peers never take): refused with the hooks where it works. In lockstep it gathers as ddp's
        does, on a host copy over the control group, beside the BSP thread's device collectives."""
        if self._keeps_own:
            raise RuntimeError(
                "all_gather while hier_bsp's workers run free (in training_step or a per-batch training "
                "hook): workers are not in step there, so the gather cannot pair them. Gather in "
                "validation, in on_train_epoch_end or after fit, where every worker has drained to the "
                "same model; a value logged with sync_dist=True inside training stays the worker's own."
            )
        if self._running_free:
            host_group = control_group() if group is None else group
            return _on_host(
                lambda host: super(HierBSPStrategy, self).all_gather(host, host_group, sync_grads), tensor
            )
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    # ------------------------------------------------------------------ checkpoints
    def _stopped_after_exception(self) -> bool:
        """Training raised: a checkpoint now comes from Lightning's exception path (callbacks'
        ``on_exception``, e.g. ``ModelCheckpoint(save_on_exception=True)``, run before the strategy's). The
        local BSP module is stopped here without a drain, which would wait for this worker's unfinished
        step (it hung until the timeout), and the other workers are told, as :meth:`on_exception` does."""
        trainer = attached_trainer(self.lightning_module)
        if self.engine is None or trainer is None or trainer.state.status != TrainerStatus.INTERRUPTED:
            return False
        if not self.engine.memory.aborted:
            self.engine.abort()
        self.engine.close()  # after abort: only ends the thread
        return True

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # after an exception: the worker's parameters are the last model it picked up from the server
        if self.engine is not None and not self._stopped_after_exception():
            self.engine.drain()  # the server's model, in every worker's parameters
            self._share_buffers()
        state = super().lightning_module_state_dict()
        return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in state.items()}

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self.engine is None:
            return super().optimizer_state(optimizer)
        if self._stopped_after_exception() and self.world_size > 1:
            # its shards live on every rank, which are no longer in step: a consolidation could hang
            rank_zero_warn(
                "hier_bsp: a checkpoint saved after an exception holds the parameter server's last model but "
                "not the optimizer state (its shards live on every rank, which are no longer in step); "
                "resuming from it starts the optimizer afresh."
            )
            state = {"state": {}, "param_groups": self.engine.server.sharding.saved_param_groups()}
        else:
            state = self.engine.optimizer_state_dict()  # drains first (not after an exception: stopped)
        # the settings as the training loop holds them now (an LR scheduler may have stepped since the
        # last superstep, whose settings the server's copy holds): what the next step uses, and ddp saves
        for saved, group in zip(state["param_groups"], optimizer.param_groups):
            saved.update({k: v for k, v in group.items() if k != "params"})
        return state

    def _can_restore_before_setup(self, ckpt_path: Any) -> bool:
        return True  # one file, the whole model: the server starts from the module (on_train_start)

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        if self.engine is not None and not self._awaiting_setup:  # before setup: the previous run's engine
            self.engine.load_params()

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        if self.engine is None:
            return super().load_optimizer_state_dict(checkpoint)
        states = checkpoint["optimizer_states"]
        if len(states) == 0:
            return None  # none saved (an empty list or dict): nothing to load, as Lightning's own loader does
        if len(states) != 1:
            raise ValueError(
                f"the checkpoint holds {len(states)} optimizer states; HierBSPStrategy uses one."
            )
        self._rebuild_when_profiled()  # over the groups a callback restored in on_fit_start (BaseFinetuning)
        self.engine.load_optimizer_state_dict(states[0])
        for group, saved in zip(self.optimizers[0].param_groups, states[0]["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})  # what schedulers resume from
        return None

    # ------------------------------------------------------------------ teardown
    def _give_back_optimizer(self) -> None:
        """After a fit the user's optimizer holds the server's state, as ``ddp`` leaves it: the server
        steps a copy of it, sharded, so without this ``trainer.optimizers[0].state_dict()`` after fit had
        no state and a second fit of the same object began Adam's moments afresh. A consolidation (a
        collective over each node, every rank at teardown); skipped after an exception, when peers may be
        gone, as hier_sliced keeps its shards then. Once per fit: a later validate / test keeps the closed
        engine of the fit, whose thread (the one that issues on its groups) has ended."""
        assert self.engine is not None
        memory = self.engine.memory
        if memory.aborted or memory.error is not None or not dist.is_initialized():
            return
        if not self.engine.module.is_alive() or not self.optimizers:
            return
        optimizer = self.optimizers[0]
        optimizer.load_state_dict(self.optimizer_state(optimizer))

    def on_exception(self, exception: BaseException) -> None:
        """Training raised on this rank: the other workers are told at the next tick and stop with an
        error naming it, and teardown does not drain (a drain would wait for this worker's step)."""
        super().on_exception(exception)
        if self.engine is not None:
            self.engine.abort()

    def teardown(self) -> None:
        if self.engine is not None:
            self._give_back_optimizer()
            self.engine.close()
        unroute_gradient_clipping(self.precision_plugin)
        if self.optimizers:
            unroute_zero_grad(self, 0)
        trainer = attached_trainer(self.lightning_module)
        if trainer is not None:
            restore_sigterm_broadcast(trainer)
            restore_validation_check(trainer)
            restore_epoch_end(trainer)
            unmark_train_data_loading(trainer)
        super().teardown()


# Lightning's hook names (``LightningModule._current_fx_name``) from a training batch's start to its end
_PER_BATCH_HOOKS = frozenset(
    {
        "on_train_batch_start",
        "training_step",
        "on_before_backward",
        "backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "configure_gradient_clipping",
        "optimizer_step",
        "on_before_zero_grad",
        "optimizer_zero_grad",
        "on_train_batch_end",
    }
)


def _on_host(collective: Callable[[Any], Any], tensor: Any) -> Any:
    """``collective`` on a host copy of a device tensor, the result moved back: between drains the local BSP
    module issues the device's collectives from its own thread, and the device rule (one issuing order
    per device) leaves the worker's thread the host backend only (gloo, on the control group)."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type == "cpu":
        return collective(tensor)
    return collective(tensor.cpu()).to(tensor.device)


# Lightning's reduce_op spellings (a ReduceOp, or its name in any case) that a host backend takes;
# "mean"/"avg" is a sum divided by the world size
_HOST_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR,
    "bxor": dist.ReduceOp.BXOR,
}


def _host_reduce_op(reduce_op: Any) -> tuple[Any, bool]:
    """``(op, divide by the world size)`` for ``reduce_op``: ``None`` is a sum (as Lightning's
    ``_sync_ddp``), ``"mean"``/``"avg"``/``ReduceOp.AVG`` a sum then divided. ``ValueError`` otherwise."""
    if reduce_op is None:
        return dist.ReduceOp.SUM, False
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
        if name in ("mean", "avg"):
            return dist.ReduceOp.SUM, True
        if name in _HOST_REDUCE_OPS:
            return _HOST_REDUCE_OPS[name], False
    elif isinstance(reduce_op, (dist.ReduceOp, dist.ReduceOp.RedOpType)):  # not a plain int, equal to one
        if reduce_op == dist.ReduceOp.AVG:
            return dist.ReduceOp.SUM, True
        for op in _HOST_REDUCE_OPS.values():
            if reduce_op == op:
                return op, False
    raise ValueError(
        f"hier_bsp reduces host values with reduce_op None, 'mean', 'avg', {sorted(_HOST_REDUCE_OPS)} or "
        f"the ReduceOp of one of them; got {reduce_op!r}."
    )


def _reduce_on_host(tensor: torch.Tensor, group: Any | None, reduce_op: Any) -> torch.Tensor:
    """Lightning's ``_sync_ddp`` on the host, without its barrier: a host copy (the tensor itself if it is
    one, reduced in place as ddp does) all-reduced over the control group (or ``group``), a mean as a sum
    divided by the group's size (an integer tensor keeps its dtype, truncated as Lightning does on gloo),
    the result moved back to the tensor's device with one copy.

    Lightning's own passes ``ReduceOp.AVG`` to any group whose backend is not plain ``"gloo"``, which gloo,
    the host backend of ``"cuda:nccl,cpu:gloo"``, refuses (torch 2.13's on integer tensors only), and its
    barrier is a device collective on CUDA (the group's bound device) from this thread, beside the BSP
    thread's; a CPU run shows the first, and only that the barrier is called. The device-to-host copy of a
    device tensor (a logged loss) waits for the device: what ``sync_dist=True`` costs here."""
    op, mean = _host_reduce_op(reduce_op)
    if not dist.is_initialized():
        return tensor
    group = control_group() if group is None else group
    host = tensor if tensor.device.type == "cpu" else tensor.cpu()
    dist.all_reduce(host, op=op, group=group)
    if mean:
        size = dist.get_world_size(group)
        if torch.is_floating_point(host):
            host.div_(size)
        else:
            host.copy_(host / size)
    return host if host is tensor else host.to(tensor.device)
