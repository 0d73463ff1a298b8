"""What the three strategies share with each other and with Lightning's ``DDPStrategy``.

:class:`HierStrategy` holds the plumbing, so each strategy's own file is the adapter of its technique:

- ``DDPStrategy``'s arguments, so a ``DDPStrategy(...)`` call or config runs unchanged; the three that
  change nothing here (no ``DistributedDataParallel`` wraps the model) warn once when set;
- the process-group backend (``"cuda:nccl,cpu:gloo"`` on CUDA, so host-side control data is legal on
  every group) and the exit handler that destroys the groups before the interpreter shuts down;
- the order of :meth:`HierStrategy.setup_distributed`: the run is validated before the process group,
  and so before any collective, exists;
- pickling (``torch.save(trainer)``, ``copy.deepcopy``) without the live distributed state;
- restoring a checkpoint's module and callbacks before ``on_fit_start``, as ``ddp`` does;
- ``on_exception`` / ``teardown``: after a failure, teardown waits in no collective for peers that may be
  gone; a failure of the communication names the lost rank(s) (every process beats in the job's store,
  :mod:`lightning_hier.liveness`) in an ERROR log line and a note on the exception;
- the strategy's registration with Lightning's ``StrategyRegistry``.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_hier import liveness
from lightning_hier.audit import start_from_env
from lightning_hier.strategies.checkpoint_files import SameDirectoryCheckpointIO
from lightning_hier.strategies.lightning_patches import (
    attached_trainer,
    requested_backend,
    restore_modules_and_callbacks,
    run_arguments,
)
from lightning_hier.strategies.process_group_exit import destroy_process_group_at_exit
from lightning_hier.topology import Topology, gather_hosts, nodes_across_hosts_problem, resolve_backend

log = logging.getLogger(__name__)

#: ``DDPStrategy.__init__``'s arguments that the strategies take as they are
DDP_ARGUMENTS = (
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
    "process_group_backend",
    "timeout",
    "start_method",
)

#: ``DDPStrategy`` arguments accepted and ignored (no ``DistributedDataParallel`` here), with their defaults
IGNORED_DDP_DEFAULTS = {
    "find_unused_parameters": False,
    "static_graph": False,
    "gradient_as_bucket_view": False,
}


def _add_note(exception: BaseException, note: str) -> None:
    if sys.version_info >= (3, 11) and note not in getattr(exception, "__notes__", ()):
        exception.add_note(note)


def _noting_lost_ranks(teardown: Callable[[Any], None]) -> Callable[[Any], None]:
    """A strategy's ``teardown`` whose error, after a failure that named lost ranks, names them too: a
    teardown that waits on a background thread's communication (HybridEmbedding's row updates) raises
    that thread's error in place of the one the ranks were named on."""

    @functools.wraps(teardown)
    def noting(self: HierStrategy) -> None:
        try:
            teardown(self)
        except BaseException as error:
            note = getattr(self, "_lost_note", None)
            if note is not None:
                _add_note(error, note)
            raise

    return noting


def ddp_arguments(given: Mapping[str, Any]) -> dict[str, Any]:
    """The ``DDPStrategy`` arguments among a constructor's ``locals()``, for :class:`HierStrategy`."""
    return {name: given[name] for name in (*DDP_ARGUMENTS, *IGNORED_DDP_DEFAULTS) if name in given}


class HierStrategy(DDPStrategy):
    """Base of ``hier_sliced``, ``hier_bsp`` and ``hier_pipeline``: Lightning's DDP launch and default
    process group, with the shared plumbing above; a subclass adds its technique."""

    #: the name users pass as ``Trainer(strategy=...)``
    strategy_name: ClassVar[str]
    #: one line for Lightning's ``StrategyRegistry``
    strategy_description: ClassVar[str] = ""
    #: why the strategy needs none of the ignored DDP arguments (``find_unused_parameters`` ...)
    ignored_ddp_reason: ClassVar[str] = "no DistributedDataParallel wraps the model."
    #: attribute name -> factory of the value a strategy has before ``setup_distributed``; pickled copies
    #: get the fresh value (process groups, threads and shared-memory views mean nothing in another process)
    _runtime_state: ClassVar[dict[str, Callable[[], Any]]] = {}

    # restore order (see restore_checkpoint_after_setup)
    _restored_in_setup: bool = False
    _restores_before_setup: bool = False  # Lightning restores this run's module and callbacks before setup
    _awaiting_setup: bool = False  # ... and the strategy's setup has not run yet

    def __init__(self, **arguments: Any) -> None:
        ignored = {name: arguments.pop(name) for name in IGNORED_DDP_DEFAULTS if name in arguments}
        unknown = sorted(set(arguments) - set(DDP_ARGUMENTS))
        if unknown:
            raise TypeError(f"{type(self).__name__} got unexpected arguments {unknown}.")
        self._warn_ignored_ddp_arguments(ignored)
        super().__init__(**arguments)
        self._failed = False  # an exception ended the run: teardown waits for no peer
        self._heartbeat: liveness.Heartbeat | None = None  # this process's beat, from setup to teardown
        self._lost_note: str | None = None  # the lost ranks named after this run's failure

    def _warn_ignored_ddp_arguments(self, given: Mapping[str, Any]) -> None:
        changed = [
            f"{name}={value!r}" for name, value in given.items() if value != IGNORED_DDP_DEFAULTS[name]
        ]
        if changed:
            rank_zero_warn(
                f"{type(self).__name__} ignores {', '.join(changed)}: these DDPStrategy arguments are "
                "accepted so that a DDPStrategy call or config runs unchanged, but no "
                f"DistributedDataParallel wraps the model here: {self.ignored_ddp_reason}"
            )

    # ------------------------------------------------------------------ process group
    @property
    def checkpoint_io(self) -> CheckpointIO:
        """Lightning's default, except that a local save is written beside its final name and renamed into
        place (:class:`SameDirectoryCheckpointIO`: a save cut short leaves nothing in ``TMPDIR``); a
        ``checkpoint_io`` or IO plugin the user gives is kept."""
        if self._checkpoint_io is None:
            self._checkpoint_io = SameDirectoryCheckpointIO()
        elif isinstance(self._checkpoint_io, _WrappingCheckpointIO):
            self._checkpoint_io.checkpoint_io = SameDirectoryCheckpointIO()  # kept if one was configured
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._checkpoint_io = io

    @property
    def planned_world_size(self) -> int:
        """The processes of the run (``num_nodes x devices``), known before the process group exists."""
        return self.num_nodes * self.num_processes

    def setup_distributed(self) -> None:
        """Validate the run, then build the default group; nothing is sent before the validation passed."""
        self._validate_before_process_group()
        start_from_env()  # the emulated backend and the audit where the environment asks for them
        super().setup_distributed()
        destroy_process_group_at_exit()
        self._start_heartbeat()
        self._after_process_group()

    def _start_heartbeat(self) -> None:
        """Beat in the job's store for the whole run, so that a peer's failed collective can name this rank
        lost or not (one thread per process, shared with hier_bsp's module; no collective)."""
        if self._heartbeat is not None or not dist.is_available() or not dist.is_initialized():
            return
        if dist.get_world_size() == 1:
            return
        self._heartbeat = liveness.Heartbeat(liveness.new_run_key(), dist.get_rank())
        self._heartbeat.start()

    def _stop_heartbeat(self) -> None:
        heartbeat, self._heartbeat = self._heartbeat, None
        if heartbeat is not None:
            heartbeat.stop()

    def _node_of(self, rank: int) -> int:
        """The node of global ``rank``: the strategy's topology where it has one, else its host."""
        topology = getattr(self, "topology", None)
        if isinstance(topology, Topology):
            return rank // topology.devices_per_node
        return rank // max(1, self.num_processes)

    def _name_lost_ranks(self, exception: BaseException) -> None:
        """After a failed collective: which ranks stopped beating (a few seconds' watch, every store call
        bounded), said in an ERROR log line and, on Python 3.11+, in a note the traceback shows."""
        # Reached only where the failure raised. Under NCCL a collective whose peer died may instead wait
        # until NCCL's watchdog ends the process, and nothing is named; a CPU run cannot show that
        # (docs/gpu.md).
        heartbeat = self._heartbeat
        if heartbeat is None or not heartbeat.beating or not liveness.from_communication(exception):
            return
        world_size = dist.get_world_size() if dist.is_initialized() else self.planned_world_size
        lost = liveness.lost_ranks(heartbeat.run_key, world_size)
        if lost == []:
            return  # every rank still beats: the error says what failed
        cause = f"{type(exception).__name__}: {str(exception).splitlines()[0] if str(exception) else ''}"
        if lost is None:
            note = (
                f"{self.strategy_name}: the job's key-value store is unreachable: its host, global rank 0 "
                f"(node {self._node_of(0)}), may be the lost rank: {cause}"
            )
        else:
            note = "; ".join(
                f"{self.strategy_name}: rank {rank} (node {self._node_of(rank)}) is gone: its heartbeat "
                "stopped" for rank in lost
            )
            note = f"{note}; the collective failed with: {cause}"
        log.error(note)
        self._lost_note = note
        _add_note(exception, note)

    def _validate_before_process_group(self) -> None:
        """Raise on a run the strategy cannot serve (settings, callbacks, the module); no collective yet."""

    def _after_process_group(self) -> None:
        """The strategy's own groups and layout, once the default group exists (every rank calls it)."""

    def _get_process_group_backend(self) -> str:
        # "cuda:nccl,cpu:gloo" on CUDA: host-side control data is legal on every group (topology.py)
        return resolve_backend(self.root_device, requested_backend(self))

    def _warn_if_nodes_span_hosts(self, topology: Topology) -> str | None:
        """Gather every rank's host (a collective) and warn on rank 0 where one node of ``topology`` runs on
        several hosts (``devices_per_node`` larger than a host's processes, or ranks numbered round-robin
        over the hosts): the results stay right, but the in-node link is then the network and a node's
        shared memory cannot be shared. Returns the problem (the same on every rank), or ``None``."""
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        problem = nodes_across_hosts_problem(topology, gather_hosts())
        if problem is not None:
            rank_zero_warn(
                f"{self.strategy_name}: {problem} Until then the job runs, but its in-node traffic crosses "
                "the network.",
                category=UserWarning,
            )
        return problem

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        for name, fresh in self._runtime_state.items():
            if name in state:
                state[name] = fresh()
        state["_heartbeat"] = None  # a thread of this process
        return state

    # ------------------------------------------------------------------ restore order
    # These strategies can load a checkpoint only once they are set up (flat buckets, pipeline stages and
    # server shards must exist first). A strategy that says so gets another order from Lightning's
    # Trainer._run: module and callbacks restored *after* the on_fit_start hooks, without fit's
    # weights_only. Callbacks acting on their restored state in on_fit_start then go wrong (Timer takes
    # a step past its budget, StochasticWeightAveraging loads SWALR state into the user's scheduler). So
    # the module and callbacks are restored at the end of the strategy's own setup, still before
    # on_fit_start, or, where _can_restore_before_setup allows it, by Lightning exactly where it does for
    # ddp (before configure_optimizers). Optimizer and loop states are Lightning's, after on_fit_start.
    def _can_restore_before_setup(self, ckpt_path: Any) -> bool:
        """Whether the module and callbacks of ``ckpt_path`` load into the module before this strategy's
        setup (as under ``ddp``); the optimizer states are always restored after it."""
        return False

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # read twice per run by Lightning, before and after setup: False before it where the checkpoint can
        # be loaded then (Lightning restores as for ddp); after setup, False once restored (no second time)
        if self._restored_in_setup or self._restores_before_setup:
            return False
        trainer = attached_trainer(getattr(self, "lightning_module", None))
        # if Lightning renames _run's arguments, nothing is found and Lightning's own order applies
        arguments = run_arguments(trainer) if trainer is not None else None
        if arguments is not None and arguments[0] and self._can_restore_before_setup(arguments[0]):
            self._restores_before_setup = self._awaiting_setup = True
            return False
        return True

    def _restore_at_end_of_setup(self, trainer: pl.Trainer) -> None:
        """Restore the module, the datamodule and the callbacks from the checkpoint this run was given
        (unless Lightning did before the setup); the last step of every strategy's ``setup``."""
        self._restored_in_setup = self._awaiting_setup = False
        if self._restores_before_setup:
            return
        arguments = run_arguments(trainer)
        if arguments is None or not arguments[0]:
            return
        ckpt_path, weights_only = arguments
        restore_modules_and_callbacks(trainer, ckpt_path, weights_only)
        self._restored_in_setup = True

    # ------------------------------------------------------------------ end of a run
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True  # teardown must not wait in a collective for ranks that may be gone
        self._name_lost_ranks(exception)
        super().on_exception(exception)

    def teardown(self) -> None:
        # the next run asks again before its setup, and starts unfailed
        self._restored_in_setup = self._restores_before_setup = self._awaiting_setup = False
        self._failed = False
        self._lost_note = None
        self._stop_heartbeat()
        super().teardown()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "teardown" in cls.__dict__:
            cls.teardown = _noting_lost_ranks(cls.__dict__["teardown"])  # type: ignore[method-assign]

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description=cls.strategy_description)
