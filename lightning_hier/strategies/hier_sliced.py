"""``strategy="hier_sliced"``: hierarchical sliced gradient reduction for Lightning.

A thin adapter: process launch and the default group come from Lightning's DDP machinery; the
step itself is :class:`lightning_hier.sliced.engine.HierSlicedEngine`.

Tuning attributes, decided automatically (not arguments); tests and benchmarks may set them on a strategy
before ``fit``:

- ``_reducer``: who issues each bucket's reduce-scatter -> all-reduce chain: ``"inline"`` (the backward
  hooks, with stream waits between the two: one issuing order per rank, what NCCL needs), ``"thread"`` (a
  communication thread: overlaps more on gloo, where waits block the host) or ``"auto"`` (default: inline
  on CUDA, thread on CPU). See ``docs/gpu.md``.
- ``_comm_chunk_mb``: a bucket larger than this is reduced chunk by chunk, each chunk's inter-node
  all-reduce overlapping the next chunk's intra-node reduce-scatter. ``None`` (default): 4 on CUDA (NCCL
  reaches its bandwidth with large messages), 1 on CPU (gloo's slow intra-node hop shows at the
  pipeline's head and tail).
- ``_full_gradients_in_hooks``: ``"auto"`` (default) makes every ``.grad`` the averaged (``ddp``) gradient in
  ``on_after_backward`` and ``on_before_optimizer_step`` where the module or a callback overrides one of
  them (one intra-node all-gather of the gradients per step) or the module overrides
  ``configure_gradient_clipping`` (clipped there after ``super()``: one more all-gather on a clipping step),
  and leaves this rank's unreduced gradient there otherwise; ``True`` / ``False`` force it on / off. The
  optimizer always steps the averaged slices.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Sequence
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from functools import partial
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch.optim import Optimizer

from lightning_hier.bucketing.time_bucketing import TimeBuckets, resolve_bucketing
from lightning_hier.buffer_broadcast import RootBuffers
from lightning_hier.checks import check_flag, check_megabytes, check_names
from lightning_hier.sliced.checkpoints import PLAN_KEY, SlicedCheckpoints, validate_checkpoint_format
from lightning_hier.sliced.compressed_hop import inter_node_dtype_of
from lightning_hier.sliced.engine import HierSlicedEngine, TrainedParameters, take_in_new_parameters
from lightning_hier.sliced.sharded_grad_scaler import HierGradScaler
from lightning_hier.sliced.sharded_optim import refuse_shared_parameters
from lightning_hier.sliced.slicing import SlicePlan, decide_slice_plan, validate_slice_weights
from lightning_hier.sparse.node_tables import NodeTables
from lightning_hier.strategies.base import HierStrategy, ddp_arguments
from lightning_hier.strategies.callback_rules import (
    refuse_unsupported_callbacks,
    show_user_param_groups,
    stop_showing_user_param_groups,
)
from lightning_hier.strategies.gradient_readers import hooks_read_gradients, reads_clipped_gradients
from lightning_hier.strategies.lightning_patches import (
    attached_trainer,
    ddp_timeout,
    delegate_state_dict,
    install_global_norm_clipping,
    install_optimizer_toggle,
    layer_sync,
    optimizers_to_device,
    remove_global_norm_clipping,
    remove_optimizer_toggle,
    route_zero_grad,
    sync_module_states,
    unwrapped_optimizer,
    without_optimizer,
)
from lightning_hier.topology import Topology, all_ranks_group, validate_layout

log = logging.getLogger(__name__)




def _zero_grad_with_buckets(
    clear_slices: Callable[..., None], engine: HierSlicedEngine, keep_views: bool
) -> Callable[..., None]:
    """An optimizer's ``zero_grad`` that also clears ``engine``'s local gradient buckets. ``keep_views``:
    every parameter's ``.grad`` stays its (zeroed) bucket view even for ``set_to_none=True``, so the next
    backward accumulates in place instead of allocating a gradient that is then copied in."""

    def zero_grad(set_to_none: bool = True) -> None:
        clear_slices(set_to_none=set_to_none)
        engine.zero_grad(set_to_none=set_to_none and not keep_views)

    return zero_grad


class HierSlicedStrategy(HierStrategy):
    """Data-parallel training with ``ddp``'s results, gradients moved the way multi-device nodes are wired,
    and a sharded optimizer.

    Every gradient bucket is reduce-scattered inside a node (the fast link), each slice is all-reduced
    across nodes (the slow link), each rank's optimizer steps only its slices (optimizer state ``~1 /
    devices_per_node``) and the updated slices are all-gathered inside the node. See ``docs/hier_sliced.md``.

    Args:
        devices_per_node: devices joined by the fast link. ``None``: the processes per host; a smaller
            number splits a host into virtual nodes (4 CPU processes as 2 x 2).
        slice_weights: each device's share of a bucket: ``"equal"``, ``"memory"`` or ``"memory+compute"``
            (measured at setup), or ``devices_per_node`` positive numbers.
        bucket_cap_mb: size cap of one gradient bucket (what becomes ready and is sent together).
        inter_node_dtype: ``"bf16"`` or ``"fp16"``: the inter-node all-reduce carries half the bytes, with
            error feedback, at a little accuracy; ``"int8"``: about a quarter (int8 blocks with one fp32
            scale each, also with error feedback); ``"fp8"``: the same bytes with each value as float8
            e4m3, which keeps small elements (the one for Adam-like optimizers); ``None``: full precision.
        broadcast_buffers: copy buffers (BatchNorm statistics) from rank 0 where ``ddp`` does: before the
            first forward of a fit and before each forward (training, or validation while fitting) that
            follows a training forward whose backward synchronises the gradients (not an accumulating one).
        checkpoint_format: ``"consolidated"``: one file that loads into a plain LightningModule and resumes
            under any topology or ``ddp``; ``"sharded"``: each rank writes and reads its own slices.
        bucketing: ``"size"``: buckets by ``bucket_cap_mb``, each sent when its last gradient is ready;
            ``"time"`` or a :class:`~lightning_hier.TimeBuckets`: buckets planned from profiled
            gradient-ready times (``docs/time_bucketing.md``); ``"none"``: all after backward (a baseline).
        elementwise_optimizers: class names of your optimizers whose update is elementwise, sharded like
            torch's ``SGD`` and ``Adam``.
        shard_optimizer: ``None``: shard an elementwise optimizer and keep any other whole on every rank
            (with a warning); ``True``: shard or refuse; ``False``: keep it whole.

    The other arguments are ``DDPStrategy``'s; ``timeout`` also bounds how long a dead peer can stall the
    others. ``find_unused_parameters``, ``static_graph`` and ``gradient_as_bucket_view`` change nothing and
    warn when set.
    """

    _runtime_state = {
        "topology": lambda: None,
        "engine": lambda: None,
        "engines": list,
        "_backward_engines": list,
        "tables": NodeTables,
        "_table_exchange": lambda: None,
        "_rank_0_buffers": lambda: None,
    }

    strategy_name = "hier_sliced"
    strategy_description = (
        "Hierarchical sliced gradient reduction (intra-node reduce-scatter, inter-node all-reduce, sharded "
        "optimizer, intra-node all-gather)"
    )
    ignored_ddp_reason = (
        "every parameter's gradient is reduced each step (zeros for one that got none), what "
        "find_unused_parameters=True gives ddp."
    )

    def __init__(
        self,
        devices_per_node: int | None = None,
        slice_weights: str | list[float] = "equal",
        bucket_cap_mb: float = 25.0,
        inter_node_dtype: Literal["bf16", "fp16", "int8", "fp8"] | None = None,
        broadcast_buffers: bool = True,
        checkpoint_format: Literal["consolidated", "sharded"] = "consolidated",
        bucketing: Literal["size", "time", "none"] | TimeBuckets = "size",
        elementwise_optimizers: Sequence[str] = (),
        shard_optimizer: bool | None = None,
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
        if devices_per_node is not None:
            validate_layout(devices_per_node, devices_per_node)
        validate_slice_weights(slice_weights, devices_per_node)
        check_megabytes("bucket_cap_mb", bucket_cap_mb)
        mode, time_config = resolve_bucketing(bucketing)
        check_flag("broadcast_buffers", broadcast_buffers)
        check_flag("shard_optimizer", shard_optimizer, allow_none=True)
        elementwise_optimizers = check_names("elementwise_optimizers", elementwise_optimizers)
        inter_node_dtype_of(inter_node_dtype)
        validate_checkpoint_format(checkpoint_format)
        super().__init__(**ddp_arguments(locals()))
        self.devices_per_node = devices_per_node
        self.slice_weights = (
            slice_weights if isinstance(slice_weights, str) else [float(w) for w in slice_weights]
        )
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.inter_node_dtype = inter_node_dtype
        self.broadcast_buffers = broadcast_buffers
        self.checkpoint_format = checkpoint_format
        self.bucketing = mode
        self.time_config = time_config
        self.elementwise_optimizers = tuple(elementwise_optimizers)
        self.shard_optimizer = shard_optimizer
        # tuning attributes (module docstring)
        self._reducer: Literal["auto", "inline", "thread"] = "auto"
        self._comm_chunk_mb: float | None = None
        self._full_gradients_in_hooks: bool | Literal["auto"] = "auto"
        self._full_gradients = False  # decided at setup
        self._full_gradients_after_clipping = False  # decided at setup
        self.topology: Topology | None = None
        self.slice_plan: SlicePlan | None = None
        self.engine: HierSlicedEngine | None = None  # the first optimizer's (the only one, usually)
        self.engines: list[HierSlicedEngine] = []  # one per optimizer
        self._backward_engines: list[HierSlicedEngine] = []  # those the running backward feeds
        self.tables = NodeTables()
        self._checkpoint_engine_state: dict[str, Any] | None = None
        self._table_exchange: Topology | None = None  # the tables' thread's own groups, built once
        # ddp's buffer broadcast while fitting (None otherwise), and whether the running training step only
        # accumulates its gradients (Lightning's block_backward_sync, ddp's no_sync)
        self._rank_0_buffers: RootBuffers | None = None
        self._backward_sync_blocked = False
        self._nodes_span_hosts: str | None = None  # what is wrong where a node's ranks run on several hosts

    # ------------------------------------------------------------------ environment
    def _validate_before_process_group(self) -> None:
        topology = Topology.from_world(
            self.planned_world_size, self.global_rank_hint(), self.devices_per_node, self.num_processes
        )
        validate_slice_weights(self.slice_weights, topology.devices_per_node)
        refuse_unsupported_callbacks(self.lightning_module, "hier_sliced")

    def _after_process_group(self) -> None:
        self.topology = Topology.from_world(
            self.planned_world_size, self.global_rank, self.devices_per_node, self.num_processes
        )
        log.info("hier_sliced topology: %s", self.topology.describe())
        self._nodes_span_hosts = self._warn_if_nodes_span_hosts(self.topology)

    def global_rank_hint(self) -> int:
        return self.node_rank * self.num_processes + self.local_rank

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        sync_batchnorm = layer_sync(self)
        if fitting and sync_batchnorm:  # Trainer(sync_batchnorm=True), as ddp converts it (and reverts it)
            self.model = sync_batchnorm.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._attach_hybrid_embeddings()
        if fitting:
            self.setup_optimizers(trainer)
            wanted = self._full_gradients_in_hooks
            if wanted == "auto":
                wanted = hooks_read_gradients(self.lightning_module, trainer.callbacks)
            self._full_gradients = bool(wanted)
            module_reads = reads_clipped_gradients(self.lightning_module)
            self._full_gradients_after_clipping = self._full_gradients and module_reads
        sharding = fitting and not without_optimizer(self.optimizers)
        checkpoint_engine_state, self._checkpoint_engine_state = self._checkpoint_engine_state, None
        if sharding:
            self._build_engine()
            if checkpoint_engine_state is not None:  # the time plan of a checkpoint loaded before setup
                self.engine.load_checkpoint_state(checkpoint_engine_state)
        else:
            if fitting:  # no optimizer: nothing to shard, the parameters stay as they are
                self.engines, self.engine = [], None
            sync_module_states(self.model)
        self.setup_precision_plugin()  # (re)creates the LightningOptimizer wrappers
        if sharding:
            self._route_zero_grad()
            install_optimizer_toggle(
                self.lightning_module,
                lambda optimizer: self.engine_for(optimizer).params,
                TrainedParameters(lambda: self.engines),
            )
            show_user_param_groups(trainer.callbacks, lambda: self.engines)  # BaseFinetuning's
            optimizers_to_device(self.optimizers, self.root_device)
            install_global_norm_clipping(self.precision_plugin, self)
            self._install_sharded_grad_scaler()
        self._rank_0_buffers = None
        if fitting and self.broadcast_buffers and self.world_size > 1:
            # ddp wraps the module anew for each fit, with a broadcast due at its first forward
            self._rank_0_buffers = RootBuffers(0, all_ranks_group(ddp_timeout(self)), self.root_device)
        self._restore_at_end_of_setup(trainer)  # the checkpoint's module and callbacks, before on_fit_start

    def _groups(self) -> Topology:
        assert self.topology is not None
        if self.topology.intra_group is None:
            self.topology = self.topology.build_groups(ddp_timeout(self))
        return self.topology

    def _attach_hybrid_embeddings(self) -> None:
        """Local rank 0 of each node creates every HybridEmbedding table in shared memory; the rest map it."""
        assert self.lightning_module is not None
        self.tables = NodeTables(self.lightning_module)
        if self.tables and self._nodes_span_hosts is not None:  # the same on every rank: all raise
            raise ValueError(
                "HybridEmbedding keeps one table per node in the memory its host's processes share, so a "
                f"node's ranks must run on one host: {self._nodes_span_hosts}"
            )
        if self.tables:
            topology = self._groups()
            # the tables' exchanges run on a thread of their own, so on groups of their own; they carry
            # the host tables' sparse gradients only, so gloo alone (no NCCL communicator behind them)
            if self._table_exchange is None:
                self._table_exchange = topology.build_groups(
                    ddp_timeout(self), dedicated="tables", host_only=("world", "intra", "inter")
                )
            exchange = self._table_exchange
            self.tables.attach(
                topology.intra_group,
                topology.inter_group,
                topology.local_rank,
                exchange_groups=(exchange.intra_group, exchange.inter_group),
            )

    def _route_zero_grad(self) -> None:
        """``optimizer.zero_grad()`` also clears this rank's local gradient buckets. The sharded optimizer
        holds slices only, so its own ``zero_grad`` would leave the full local gradients to be summed into
        the next backward: under manual optimization, and under automatic optimization wherever a step
        is skipped (a user's ``optimizer_step`` that runs the closure and steps only on some batches, such
        as skipping non-finite losses; ddp drops that batch's gradients at the next ``zero_grad``). The
        strategy leaves them after a step until this ``zero_grad``, as ddp leaves ``.grad``, so a module
        whose ``optimizer_zero_grad`` skips batches accumulates across steps as under ddp. Automatic
        optimization keeps the ``.grad`` views (zeroed), so backward accumulates in place."""
        assert self.lightning_module is not None and self.engine is not None
        keep_views = self.lightning_module.automatic_optimization
        for index, (optimizer, engine) in enumerate(zip(self.optimizers, self.engines)):
            route_zero_grad(self, index, _zero_grad_with_buckets(optimizer.zero_grad, engine, keep_views))
            delegate_state_dict(self, index)

    def _build_engine(self) -> None:
        assert self.topology is not None and self.lightning_module is not None
        self._check_optimizers()
        self._groups()
        if self.slice_plan is None:
            self.slice_plan = decide_slice_plan(
                self.slice_weights,
                self.topology.devices_per_node,
                self.root_device,
                self.num_processes,
                group=self.topology.world_group,
            )
        for engine in self.engines:
            engine.close()  # an optimizer it still holds is given back by the engine built for it next
        self.engines = [
            HierSlicedEngine(
                self.lightning_module,
                optimizer,
                self.topology,
                slice_plan=self.slice_plan,
                bucket_cap_mb=self.bucket_cap_mb,
                bucketing=self.bucketing,
                time_config=self.time_config,
                comm_chunk_mb=self._comm_chunk_mb,
                reducer=self._reducer,
                elementwise_optimizers=self.elementwise_optimizers,
                shard_optimizer=self.shard_optimizer,
                inter_node_dtype=inter_node_dtype_of(self.inter_node_dtype),
            )
            for optimizer in self.optimizers
        ]
        self._refuse_what_a_whole_optimizer_cannot_serve()
        for engine in self.engines:
            engine.open_unannounced_backward = self._open_unannounced_backward
        self.engine = self.engines[0]
        self.engine.sync_module_states()  # every parameter and buffer of the module, once
        log.info(
            "hier_sliced: %s bucket(s), slice weights %s",
            " + ".join(str(len(engine.buckets)) for engine in self.engines),
            [round(w, 4) for w in self.slice_plan.weights],
        )

    def _refuse_what_a_whole_optimizer_cannot_serve(self) -> None:
        """An optimizer kept whole on every rank (``shard_optimizer``) has no slices to write per rank or to
        decide a 16-bit loss scaler's skip from; the same on every rank, so every rank raises."""
        whole = [type(engine.optimizer).__name__ for engine in self.engines if engine.replicated]
        plugin = self.precision_plugin
        unsupported = {
            "checkpoint_format='sharded'": self.checkpoint_format == "sharded",
            "precision='16-mixed'": isinstance(plugin, MixedPrecision) and plugin.scaler is not None,
        }
        for setting, used in unsupported.items():
            if whole and used:
                for engine in self.engines:
                    engine.close()
                raise ValueError(
                    f"HierSlicedStrategy keeps {', '.join(whole)} whole on every rank (not elementwise, or "
                    f"shard_optimizer=False), which does not support {setting}; use an elementwise "
                    "optimizer, or drop the setting."
                )

    def _check_optimizers(self) -> None:
        """Several optimizers (manual optimization, a GAN's generator and discriminator): each is sharded
        over its own buckets. What follows one optimizer's plan or state is refused for several."""
        if len(self.optimizers) < 2:
            return
        unsupported = {
            "bucketing='time'": self.bucketing == "time",
            "checkpoint_format='sharded'": self.checkpoint_format == "sharded",
            "HybridEmbedding tables": bool(self.tables),
        }
        for setting, used in unsupported.items():
            if used:
                raise ValueError(
                    f"HierSlicedStrategy with {len(self.optimizers)} optimizers does not support {setting} "
                    "(it follows one optimizer's plan); use one optimizer, or drop the setting."
                )
        refuse_shared_parameters(self.optimizers, self.lightning_module)

    def engine_for(self, optimizer: Optimizer) -> HierSlicedEngine:
        """The engine sharding ``optimizer`` (or the LightningOptimizer wrapping it)."""
        optimizer = unwrapped_optimizer(optimizer)
        for engine in self.engines:
            if engine.optimizer is optimizer:
                return engine
        raise ValueError("this optimizer was not set up by HierSlicedStrategy (created after setup?)")

    def _install_sharded_grad_scaler(self) -> None:
        """16-bit AMP: skip-or-step must be decided from every slice and every embedding table's
        gradient, not just this rank's slices; the user's scaler settings and state are kept."""
        plugin = self.precision_plugin
        if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
            assert self.topology is not None
            checks = self.tables.finite_checks()
            if isinstance(plugin.scaler, HierGradScaler):
                plugin.scaler.extra_finite = checks
            else:
                plugin.scaler = HierGradScaler.replacing(
                    plugin.scaler, plugin.device, self.topology.world_group, checks
                )

    @property
    def _loss_scaled(self) -> bool:
        return isinstance(getattr(self.precision_plugin, "scaler", None), HierGradScaler)

    def _table_update_factor(self) -> tuple[float, bool]:
        """``(inverse loss scale, skipped)`` of the step that just ran (``(1.0, False)`` without AMP)."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        if isinstance(scaler, HierGradScaler):
            return scaler.last_inv_scale, scaler.last_step_skipped
        return 1.0, False

    # ------------------------------------------------------------------ step
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        with ExitStack() as stack:
            for engine in self.engines:
                stack.enter_context(engine.no_sync())
            stack.callback(setattr, self, "_backward_sync_blocked", self._backward_sync_blocked)
            self._backward_sync_blocked = True
            yield None

    def _sync_buffers(self) -> None:
        """Before a forward while fitting: rank 0's buffers where DDP's wrapper sends them, the first
        forward of a fit and any forward after one whose backward synchronised the gradients (DDP's
        ``require_forward_param_sync``, set by each forward from the grad mode and ``no_sync``). So every
        rank's running statistics, and what it evaluates, are ddp's. Decided on the host, alike on every
        rank (the same steps accumulate everywhere): one broadcast per buffer dtype, no device read."""
        if self._rank_0_buffers is None:
            return
        assert self.lightning_module is not None
        synchronises = torch.is_grad_enabled() and not self._backward_sync_blocked
        self._rank_0_buffers.before_forward(list(self.lightning_module.buffers()), synchronises)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        take_in_new_parameters(self.engines)  # unfrozen or added since the last step (alike on every rank)
        super().on_train_batch_start(batch, batch_idx)

    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        self._sync_buffers()
        return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._sync_buffers()  # while fitting ddp's wrapper runs validation too (not trainer.validate's)
        return super().validation_step(*args, **kwargs)

    def backward_pass_done(self) -> None:
        """Called by the precision plugin (``lightning_patches.install_global_norm_clipping``) between the
        backward pass and ``on_after_backward``: the gradients are reduced before the hooks run, as DDP
        reduces them during backward. Lightning's ``Strategy.backward`` itself stays as it is."""
        self._finish_backward()

    def pre_backward(self, closure_loss: torch.Tensor | None) -> None:
        engines = self.engines
        if len(engines) > 1:
            # with several optimizers a backward feeds those whose parameters require a gradient now
            # (toggle_optimizer turns the others off); one overlaps with backward, several send after it
            engines = [engine for engine in engines if engine.trainable_now]
        for engine in engines:
            engine.begin_backward(overlap=len(engines) == 1)
        self._backward_engines = engines

    def _open_unannounced_backward(self) -> Callable[[], None] | None:
        """A backward Lightning did not announce: a raw ``loss.backward()`` in a manual-optimization
        ``training_step`` is synchronised like ``manual_backward``; any other (input gradients in
        ``validation_step``) only accumulates locally, as under DDP outside its forward."""
        trainer = attached_trainer(self.lightning_module)
        if trainer is None or not trainer.training:
            return None
        self.pre_backward(None)
        return self._finish_backward

    def _finish_backward(self) -> None:
        if not self._backward_engines:
            return
        if self.engine is not None and self.engine.syncing:
            # starts the tables' exchange (and, without a loss scaler to decide skip-or-step first,
            # their update) beside the dense reduction's tail; with one, optimizer_step applies it
            self.tables.sync_gradients(update=not self._loss_scaled)
        for engine in self._backward_engines:
            engine.finish_backward()
            if engine.syncing and self._full_gradients:
                engine.expose_full_gradients()

    def before_optimizer_step_hooks(self) -> None:
        """Called by the precision plugin right before ``on_before_optimizer_step``: under a loss
        scaler the slices were just unscaled, so the exposed full gradients are refreshed."""
        plugin = self.precision_plugin
        scaled = isinstance(plugin, MixedPrecision) and plugin.scaler is not None
        if self._full_gradients and scaled:
            for engine in self._backward_engines:
                engine.expose_full_gradients()

    def gradients_clipped(self, optimizer: Optimizer) -> None:
        """Called by the precision plugin right after Lightning clipped ``optimizer``'s slices: a module's own
        ``configure_gradient_clipping`` reads ``.grad`` next, so the full gradients are gathered again from
        the clipped slices, what ``ddp`` shows there (one more intra-node all-gather on a clipping step)."""
        engine = self.engine_for(optimizer)
        if self._full_gradients_after_clipping and engine.syncing:
            engine.expose_full_gradients()

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.engines:
            # the gradients stay until the optimizer's zero_grad (routed to the buckets), as under ddp:
            # a module whose optimizer_zero_grad skips some batches adds them to the next step's
            self.engine_for(optimizer).after_step(clear_gradients=False)
        self.tables.apply_update(*self._table_update_factor())
        return output

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpoints(self) -> SlicedCheckpoints:
        """How checkpoints are written and read (:mod:`lightning_hier.sliced.checkpoints`)."""
        return SlicedCheckpoints(self.checkpoint_format)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self.engine is None:
            return super().optimizer_state(optimizer)
        return self.checkpoints.optimizer_state(self.engine_for(optimizer))

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        self.tables.save(checkpoint, filepath, write=self.is_global_zero)
        write_file = partial(super().save_checkpoint, filepath=filepath, storage_options=storage_options)
        self.checkpoints.save(self.engine, checkpoint, filepath, self.is_global_zero, write_file)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            NodeTables.remove(filepath)
        self.checkpoints.remove(filepath, self.is_global_zero, super().remove_checkpoint)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        read_file = partial(super().load_checkpoint, weights_only=weights_only)
        return self.checkpoints.read(checkpoint_path, read_file, weights_only)

    def _can_restore_before_setup(self, ckpt_path: Any) -> bool:
        assert self.lightning_module is not None
        return self.checkpoints.loads_before_setup(ckpt_path, self.lightning_module)

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        # a checkpoint may be restored into a module no Trainer holds (after a spawned fit, Lightning's
        # launcher hands back a detached module): ``module.trainer`` would raise there
        trainer = attached_trainer(self.lightning_module)
        self.tables.restore(checkpoint, getattr(trainer, "ckpt_path", None))
        load_whole = super().load_model_state_dict
        engine = self.engine
        if self._awaiting_setup:  # restored before setup, as under ddp: the engines come later, with the plan
            engine, self._checkpoint_engine_state = None, checkpoint.get(PLAN_KEY)
        self.checkpoints.restore_model(engine, self.lightning_module, checkpoint, strict, load_whole)

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        if self.engine is None:
            return super().load_optimizer_state_dict(checkpoint)
        self.checkpoints.restore_optimizers(self.engines, checkpoint)
        optimizers_to_device(self.optimizers, self.root_device)
        return None

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Plain tensors (not views into the flat buckets), loadable into the bare module; when sharded,
        only what the slices do not cover."""
        return self.checkpoints.module_state(self.engine, super().lightning_module_state_dict())

    # ------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        self.tables.close()
        # after a fit the optimizers are given back as ddp leaves them (the module's parameters, the full
        # state): trainer.optimizers[i].state_dict() is the unsharded one, and a later fit may reuse the
        # object; a checkpoint saved after fit then holds the optimizer's own state_dict(). With
        # checkpoint_format="sharded" (or after an exception, when peers may be gone) the optimizers stay
        # sharded and such a checkpoint consolidates through the engines, which are kept either way
        # (on one device per node no peer takes part, so an exception does not rule it out)
        alone = self.topology is not None and self.topology.devices_per_node == 1
        give_back = (not self._failed or alone) and self.checkpoint_format != "sharded"
        give_back = give_back and dist.is_initialized()
        for engine in self.engines:
            engine.close()
            if give_back:
                engine.give_back_optimizer()
        remove_global_norm_clipping(self.precision_plugin)
        remove_optimizer_toggle(self.lightning_module)
        stop_showing_user_param_groups(self.lightning_module)
        self._rank_0_buffers = None
        super().teardown()
