"""Every use of Lightning beyond its public API, in one module, checked against the installed version.

The strategies serve Lightning's contract with a few of Lightning's internals: methods replaced on the
trainer's loops, the precision plugin and the optimizers for one run (each with the function that puts
Lightning's own back), private attributes read or written, and private helpers imported. Each is a small
function here whose comment names what it replaces and why; the strategies and callbacks call these and
touch no Lightning internal themselves. Wrapping the public hooks of the user's own objects (a
LightningModule's ``on_train_epoch_end``, a callback's ``on_predict_batch_end``) is Lightning's public
contract and happens where it is used (:class:`~lightning_hier.strategies.instance_hooks.InstanceHooks`).
``DDPStrategy``'s protected members that the strategies inherit are read here too; the one protected
method they override, ``_get_process_group_backend``, stays in each strategy class.

Lightning changes its internals between releases without notice, so importing this module checks the
installed Lightning against :data:`TESTED_LIGHTNING`, the range the test suite passes on, and raises
``ImportError`` outside it (``LIGHTNING_HIER_ALLOW_UNTESTED_LIGHTNING=1`` makes that a warning).
``tests/test_lightning_version.py`` checks that every internal named here exists in the installed
Lightning; CI runs it with the oldest and the newest release of the range.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import lightning
from packaging.specifiers import SpecifierSet

#: the Lightning releases the suite passes on (pyproject.toml's requirement says the same)
TESTED_LIGHTNING = ">=2.6.0,<2.7"
ALLOW_UNTESTED_ENV = "LIGHTNING_HIER_ALLOW_UNTESTED_LIGHTNING"


def check_lightning_version(version: str | None = None) -> None:
    """``ImportError`` where ``version`` (default: the installed Lightning's) is outside
    :data:`TESTED_LIGHTNING`; a ``UserWarning`` instead where ``ALLOW_UNTESTED_ENV`` is set to ``1``."""
    installed = lightning.__version__ if version is None else version
    # pre-releases inside the range count as tested; "<2.7" keeps 2.7's own release candidates out
    if SpecifierSet(TESTED_LIGHTNING).contains(installed, prereleases=True):
        return
    message = (
        f"lightning_hier supports Lightning {TESTED_LIGHTNING} (the releases its tests pass on), but "
        f"lightning {installed} is installed. The strategies use some of Lightning's internals "
        "(lightning_hier/strategies/lightning_patches.py), which change between releases, so another "
        f"release may fail or train wrongly without an error. Install a supported one: "
        f"pip install 'lightning{TESTED_LIGHTNING}'"
    )
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        warnings.warn(f"{message} ({ALLOW_UNTESTED_ENV}=1: going on untested).", UserWarning, stacklevel=2)
        return
    raise ImportError(f"{message}, or set {ALLOW_UNTESTED_ENV}=1 to go on untested.")


# before the internals below are imported: an unsupported Lightning gets this error, not a missing name
check_lightning_version()

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.fabric.utilities.optimizer import _optimizers_to_device  # noqa: E402
from lightning.pytorch.callbacks import BaseFinetuning, ModelCheckpoint  # noqa: E402
from lightning.pytorch.core.optimizer import _MockOptimizer  # noqa: E402
from lightning.pytorch.loops.optimization.automatic import ClosureResult  # noqa: E402
from lightning.pytorch.overrides.distributed import _sync_module_states  # noqa: E402
from lightning.pytorch.plugins.precision import Precision  # noqa: E402
from lightning.pytorch.trainer.states import RunningStage  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402
from lightning.pytorch.utilities.data import _update_dataloader  # noqa: E402
from lightning.pytorch.utilities.exceptions import SIGTERMException  # noqa: E402
from torch import nn  # noqa: E402
from torch.optim import Optimizer  # noqa: E402
from torch.utils.data import DataLoader, Sampler  # noqa: E402

from lightning_hier.strategies.instance_hooks import InstanceHooks  # noqa: E402

ParamsOf = Callable[[Optimizer], Sequence[nn.Parameter]]


def _set_for_run(owner: Any, name: str, value: Any) -> None:
    """``owner.name`` is ``value`` (an instance attribute over the class's method) until :func:`_unset`."""
    setattr(owner, name, value)


def _unset(owner: Any, name: str) -> None:
    """``owner.name`` is the class's own again."""
    owner.__dict__.pop(name, None)


# ---------------------------------------------------------------------- private helpers, as Lightning's own
def optimizers_to_device(optimizers: Sequence[Optimizer], device: torch.device) -> None:
    """Lightning's ``_optimizers_to_device``: the optimizers' state moved to ``device``, as ``DDPStrategy``'s
    setup and checkpoint loading do (the strategies replace those steps, not what they do)."""
    _optimizers_to_device(optimizers, device)


def sync_module_states(module: nn.Module) -> None:
    """Lightning's ``_sync_module_states``: rank 0's parameters and buffers on every rank, what DDP's wrapper
    does at construction, for a run that wraps nothing (no optimizer, or evaluation)."""
    _sync_module_states(module)


def with_train_sampler(dataloader: DataLoader, sampler: Sampler) -> DataLoader:
    """Lightning's ``_update_dataloader``: ``dataloader`` rebuilt around ``sampler`` with every other argument
    kept, as Lightning rebuilds a loader around its ``DistributedSampler``."""
    return _update_dataloader(dataloader, sampler, mode=RunningStage.TRAINING)


def unwrapped_optimizer(optimizer: Any) -> Any:
    """The optimizer a ``LightningOptimizer`` wraps (its private ``_optimizer``), or ``optimizer`` itself."""
    return getattr(optimizer, "_optimizer", optimizer)


def without_optimizer(optimizers: Sequence[Optimizer]) -> bool:
    """``configure_optimizers`` returned ``None`` (or is not defined): Lightning then fits with its private
    no-op ``_MockOptimizer`` and the model is never updated, so there is nothing to shard or to serve. The
    strategies then train like Lightning does (the parameters stay as they are)."""
    unwrapped = [unwrapped_optimizer(optimizer) for optimizer in optimizers]
    return bool(unwrapped) and all(isinstance(optimizer, _MockOptimizer) for optimizer in unwrapped)


def training_step_loss(output: Any) -> tuple[torch.Tensor | None, dict[str, Any]]:
    """``(loss, extra keys)`` of a ``training_step``'s output, read by the automatic loop's own
    ``ClosureResult`` (an internal class): the same errors for invalid outputs, ``None`` to skip the batch,
    and the extra keys Lightning hands to ``on_train_batch_end``."""
    result = ClosureResult.from_training_step_output(output)
    return result.closure_loss, result.extra


def run_closure(plugin: Precision, model: pl.LightningModule, optimizer: Optimizer, closure: Any) -> Any:
    """The precision plugin's private ``_wrap_closure``: the closure (forward, backward) and the hooks
    before the step, as the plugin's ``optimizer_step`` runs them, without stepping the optimizer."""
    return plugin._wrap_closure(model, optimizer, closure)


# ---------------------------------------------------------------------- private attributes read or written
def attached_trainer(module: pl.LightningModule | None) -> pl.Trainer | None:
    """The Trainer holding ``module`` (its private ``_trainer``), or ``None``: ``module.trainer`` raises
    where there is none (a module restored after a spawned fit, a strategy set up by hand)."""
    return module._trainer if module is not None else None


def current_hook(module: pl.LightningModule) -> str | None:
    """The name of the Lightning hook now running on ``module`` (its private ``_current_fx_name``)."""
    return module._current_fx_name


def compiled_by_trainer(module: pl.LightningModule) -> bool:
    """Whether Lightning compiled the module's forward and ``*_step`` methods (a ``torch.compile``'d module
    passed to the Trainer: its private ``_compiler_ctx``); ``lightning.pytorch.utilities.compile
    .to_uncompiled`` undoes it."""
    return module._compiler_ctx is not None


def saves_by_steps_or_time(callback: ModelCheckpoint) -> bool:
    """Whether a ``ModelCheckpoint`` saves every N train steps or after a train-time interval (private
    ``_every_n_train_steps`` / ``_train_time_interval``; its constructor arguments are not kept public)."""
    return bool(callback._every_n_train_steps or callback._train_time_interval)


def train_data_loaded(trainer: pl.Trainer) -> bool:
    """Whether the fit loop has built its train loader already (its private ``_combined_loader``): read
    before the strategy's setup, ``trainer.estimated_stepping_batches`` loads it."""
    return trainer.fit_loop._combined_loader is not None


def accumulating(trainer: pl.Trainer | None) -> bool:
    """Whether the running batch only accumulates gradients (the epoch loop's private
    ``_should_accumulate``); ``True`` where no fit runs."""
    if trainer is None:
        return True
    return bool(trainer.fit_loop.epoch_loop._should_accumulate())


def result_collection(trainer: pl.Trainer) -> Any:
    """The private ``_ResultCollection`` that ``self.log`` writes to in the running loop."""
    return trainer._results


def keep_users_sampler(trainer: pl.Trainer) -> None:
    """Turn off Lightning's ``DistributedSampler`` injection for this trainer (the private accelerator
    connector's ``use_distributed_sampler``, what ``Trainer(use_distributed_sampler=False)`` sets), for a
    strategy whose processes are not data-parallel replicas. Set before the data loads."""
    trainer._accelerator_connector.use_distributed_sampler = False


def optimizer_toggle_state(module: pl.LightningModule) -> dict[nn.Parameter, bool]:
    """``requires_grad`` of every parameter before the running ``toggle_optimizer`` (the module's private
    ``_param_requires_grad_state``, which ``untoggle_optimizer`` restores)."""
    return module._param_requires_grad_state


# DDPStrategy's protected members, which the strategies inherit and read (DDPStrategy keeps no public ones)
def ddp_timeout(strategy: Any) -> Any:
    """The collective timeout the strategy was given (``timeout=``, a ``timedelta`` or ``None``)."""
    return strategy._timeout


def requested_backend(strategy: Any) -> str | None:
    """The ``process_group_backend`` the strategy was given (``None``: chosen from the device)."""
    return strategy._process_group_backend


def layer_sync(strategy: Any) -> Any:
    """``Trainer(sync_batchnorm=True)``'s layer sync plugin handed to the strategy, or ``None``."""
    return strategy._layer_sync


def drop_layer_sync(strategy: Any) -> None:
    """The strategy converts no layer (``sync_batchnorm`` means nothing for it)."""
    strategy._layer_sync = None


# ---------------------------------------------------------------------- the optimizers
def route_zero_grad(strategy: Any, index: int, zero_grad: Callable[..., None]) -> None:
    """Make ``zero_grad`` what the strategy's optimizer ``index`` does on ``zero_grad()``, whether the caller
    holds the optimizer (Lightning's training loop) or the ``LightningOptimizer`` that ``self.optimizers()``
    returns (the strategy's private ``_lightning_optimizers``), whose class inherits the optimizer's own
    ``zero_grad`` and so needs the attribute too. Replaces the optimizer's ``zero_grad`` for the run: a
    sharded optimizer's own clears its slices only, not the engine's local gradients. Call it after the
    precision plugin's setup, which recreates the wrappers; :func:`unroute_zero_grad` undoes it."""
    _set_for_run(strategy.optimizers[index], "zero_grad", zero_grad)
    _set_for_run(strategy._lightning_optimizers[index], "zero_grad", zero_grad)


def delegate_state_dict(strategy: Any, index: int) -> None:
    """The ``LightningOptimizer`` of the strategy's optimizer ``index`` (what ``self.optimizers()`` returns)
    hands ``state_dict()`` and ``load_state_dict()`` to the optimizer object it wraps. Its class inherits the
    optimizer class's methods, which would read the wrapped optimizer's flat slices; an engine that shards
    the optimizer answers on the object in the user's layout. The wrappers are recreated every run."""
    optimizer = strategy.optimizers[index]
    wrapper = strategy._lightning_optimizers[index]
    _set_for_run(wrapper, "state_dict", lambda: optimizer.state_dict())
    _set_for_run(wrapper, "load_state_dict", lambda state_dict: optimizer.load_state_dict(state_dict))


def unroute_zero_grad(strategy: Any, index: int) -> None:
    """The strategy's optimizer ``index`` and its ``LightningOptimizer`` zero with torch's own ``zero_grad``
    again: after the run, ``optimizer.zero_grad()`` no longer reaches the closed engine's buckets."""
    _unset(strategy.optimizers[index], "zero_grad")
    if index < len(strategy._lightning_optimizers):
        _unset(strategy._lightning_optimizers[index], "zero_grad")


def install_optimizer_toggle(
    module: pl.LightningModule, params_of: ParamsOf, all_params: Sequence[nn.Parameter]
) -> None:
    """Replace ``module.toggle_optimizer(opt)`` / ``untoggle_optimizer`` (and so ``toggled_optimizer`` and
    ``LightningOptimizer.toggle_model``, which call them) for the run. Lightning's switch ``requires_grad``
    on the tensors in each optimizer's ``param_groups``, which under ``hier_sliced`` are the sharded slices,
    so a GAN's generator backward would still leave gradients on the discriminator. These do what
    Lightning's do on the module parameters ``params_of(opt)``; ``all_params`` are every optimizer's.
    :func:`remove_optimizer_toggle` gives Lightning's back."""

    def toggle_optimizer(optimizer: Any) -> None:
        state = {param: param.requires_grad for param in all_params}
        for param in all_params:
            param.requires_grad = False
        for param in params_of(optimizer):
            param.requires_grad = state[param]
        module._param_requires_grad_state = state  # where Lightning's untoggle and its checks read it

    def untoggle_optimizer(optimizer: Any) -> None:
        for param, requires_grad in optimizer_toggle_state(module).items():
            param.requires_grad = requires_grad
        module._param_requires_grad_state = {}

    _set_for_run(module, "toggle_optimizer", toggle_optimizer)
    _set_for_run(module, "untoggle_optimizer", untoggle_optimizer)


def remove_optimizer_toggle(module: pl.LightningModule | None) -> None:
    """Give the module Lightning's own ``toggle_optimizer`` / ``untoggle_optimizer`` back."""
    if module is not None:
        for name in ("toggle_optimizer", "untoggle_optimizer"):
            _unset(module, name)


# ---------------------------------------------------------------------- the precision plugin
def _clip_grad_by_norm(self: Precision, optimizer: Optimizer, clip_val: int | float) -> None:
    strategy: Any = self._hier_strategy  # type: ignore[attr-defined]
    engine_for = getattr(strategy, "engine_for", None)  # several optimizers: the one being clipped
    engine = engine_for(optimizer) if engine_for is not None else strategy.engine
    assert engine is not None
    engine.clip_grad_norm_(float(clip_val))


def _clip_gradients_then_tell(
    self: Precision,
    optimizer: Optimizer,
    clip_val: int | float = 0.0,
    gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
) -> None:
    base = type(self)._hier_base  # type: ignore[attr-defined]
    base.clip_gradients(self, optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)
    hook = getattr(self._hier_strategy, "gradients_clipped", None)  # type: ignore[attr-defined]
    if hook is not None and clip_val > 0:  # Lightning clips nothing at 0
        hook(optimizer)


def _after_closure(self: Precision, model: Any, optimizer: Optimizer) -> None:
    hook = getattr(self._hier_strategy, "before_optimizer_step_hooks", None)  # type: ignore[attr-defined]
    if hook is not None:
        hook()
    type(self)._hier_base._after_closure(self, model, optimizer)  # type: ignore[attr-defined]


def _post_backward(self: Precision, tensor: Any, module: Any) -> Any:
    hook = getattr(self._hier_strategy, "backward_pass_done", None)  # type: ignore[attr-defined]
    if hook is not None:
        hook()
    return type(self)._hier_base.post_backward(self, tensor, module)  # type: ignore[attr-defined]


def install_global_norm_clipping(plugin: Precision, strategy: Any) -> None:
    """Swap the plugin's class for a subclass of it for the run, so that Lightning's gradient-norm clipping
    clips by the global norm where each rank holds part of the model (a slice under ``hier_sliced``, a
    stage under ``hier_pipeline``): ``clip_grad_by_norm`` goes to ``strategy.engine.clip_grad_norm_``
    (which all-reduces the squared norm). The strategy also gets a call right before
    ``on_before_optimizer_step`` (``before_optimizer_step_hooks``, from the private ``_after_closure``), one
    right after Lightning's clipping, by norm or by value (``gradients_clipped(optimizer)``, from
    ``clip_gradients``, which a module's own ``configure_gradient_clipping`` reaches through ``super()``) and
    one right after the backward pass, before ``on_after_backward`` (``backward_pass_done``, from
    ``post_backward``), so Lightning's own ``Strategy.backward`` runs unchanged (tests and tools patch it on
    the base class). A subclass rather than a wrapper keeps every ``isinstance`` check Lightning makes on
    the plugin true, and an AMP plugin still unscales before the norm. :func:`remove_global_norm_clipping`
    gives the plugin its class back."""
    base = type(plugin)
    if not getattr(base, "_hier_global_norm", False):
        methods = {
            "clip_grad_by_norm": _clip_grad_by_norm,
            "clip_gradients": _clip_gradients_then_tell,
            "_after_closure": _after_closure,
            "post_backward": _post_backward,
        }
        patched = type(f"GlobalNorm{base.__name__}", (base,), methods)
        patched._hier_global_norm = True  # type: ignore[attr-defined]
        patched._hier_base = base  # type: ignore[attr-defined]
        plugin.__class__ = patched
    plugin._hier_strategy = strategy  # type: ignore[attr-defined]


def remove_global_norm_clipping(plugin: Precision) -> None:
    """Give the plugin its own class back (at teardown)."""
    base = getattr(type(plugin), "_hier_base", None)
    if base is not None:
        plugin.__class__ = base
        _unset(plugin, "_hier_strategy")


def route_gradient_clipping(plugin: Precision, clip: Callable[[str, float], None]) -> None:
    """Replace the plugin's ``clip_gradients`` for the run by a call of ``clip(algorithm, value)`` (where a
    value is set): under ``hier_bsp`` the optimizer steps on the server thread, which clips the superstep's
    mean gradient there. :func:`unroute_gradient_clipping` gives the plugin's own back."""

    def clip_gradients(
        optimizer: Optimizer, clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        if clip_val:
            algorithm = getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm) or "norm"
            clip(str(algorithm), float(clip_val))

    _set_for_run(plugin, "clip_gradients", clip_gradients)


def unroute_gradient_clipping(plugin: Precision) -> None:
    _unset(plugin, "clip_gradients")


# ---------------------------------------------------------------------- the training loops
# the epoch loop's private method that broadcasts rank 0's SIGTERM flag before every training step
SIGTERM_BROADCAST = "_broadcast_sigterm_tensor"


def replace_sigterm_broadcast(trainer: pl.Trainer, broadcast: Callable[[], None]) -> None:
    """Replace the epoch loop's per-step SIGTERM broadcast for the run by ``broadcast`` (which raises
    ``SIGTERMException`` to end the fit, as Lightning's does). Lightning's makes the flag on the root device
    and has every rank, rank 0 too, wait for it each step; :func:`restore_sigterm_broadcast` gives it back."""
    _set_for_run(trainer.fit_loop.epoch_loop, SIGTERM_BROADCAST, broadcast)


def check_own_sigterm(trainer: pl.Trainer) -> None:
    """A replacement for the SIGTERM broadcast where each process reads its own flag (a scheduler's SIGTERM
    reaches every process): ``SIGTERMException`` once it is set."""

    def check() -> None:
        if getattr(trainer, "received_sigterm", False):
            raise SIGTERMException()

    replace_sigterm_broadcast(trainer, check)


def restore_sigterm_broadcast(trainer: pl.Trainer) -> None:
    _unset(trainer.fit_loop.epoch_loop, SIGTERM_BROADCAST)


def mark_train_data_loading(trainer: pl.Trainer, loading: Callable[[bool], None]) -> None:
    """Replace the fit loop's ``setup_data`` for the run by one that calls ``loading(True)`` before and
    ``loading(False)`` after Lightning's: Lightning hands every loader to ``Strategy.process_dataloader``
    without saying which stage it is for, and the fit loop's ``setup_data`` loads the train loaders only.
    :func:`unmark_train_data_loading` gives Lightning's back."""
    loop = trainer.fit_loop
    original = type(loop).setup_data.__get__(loop)

    def setup_data() -> None:
        loading(True)
        try:
            original()
        finally:
            loading(False)

    _set_for_run(loop, "setup_data", setup_data)


def unmark_train_data_loading(trainer: pl.Trainer) -> None:
    _unset(trainer.fit_loop, "setup_data")


def validate_at_every_epoch_end(trainer: pl.Trainer, end_every_fit: Callable[[], None]) -> None:
    """Replace the epoch loop's private ``_should_check_val_fx`` for the run, for workers that take
    different numbers of steps in an epoch (``val_check_interval`` 1.0). Lightning validates when a
    worker's batch count reaches the loader's length; a worker whose epoch ended with the others' (fewer
    batches) must validate too, or the ranks' validation collectives would not pair up.

    Lightning asks this right after ``on_train_batch_end``: the first point where a ``should_stop`` set in
    a per-batch hook of this worker alone (its own ``Timer`` clock, the user's own condition) is known.
    ``end_every_fit`` then ends the others' fits after the step they are in, so every worker validates and
    stops together. :func:`restore_validation_check` gives Lightning's back."""
    loop = trainer.fit_loop.epoch_loop

    def at_epoch_end(data_fetcher: Any) -> bool:
        stopping = trainer.should_stop and trainer.fit_loop._can_stop_early
        if stopping:
            end_every_fit()
        if not loop._should_check_val_epoch():
            return False
        return loop.batch_progress.is_last_batch or stopping

    _set_for_run(loop, "_should_check_val_fx", at_epoch_end)


def restore_validation_check(trainer: pl.Trainer) -> None:
    _unset(trainer.fit_loop.epoch_loop, "_should_check_val_fx")


def agree_after_epoch_end(trainer: pl.Trainer, agree: Callable[[pl.Trainer], None]) -> None:
    """Replace the fit loop's ``on_advance_end`` for the run by Lightning's followed by ``agree(trainer)``:
    Lightning ends an epoch there (its hooks, checkpoints, schedulers) and reads ``should_stop`` right
    after, so ``agree`` can make that decision common to every worker in between.
    :func:`restore_epoch_end` gives Lightning's back."""
    loop = trainer.fit_loop
    end_epoch = type(loop).on_advance_end.__get__(loop)

    def on_advance_end() -> None:
        end_epoch()
        agree(trainer)

    _set_for_run(loop, "on_advance_end", on_advance_end)


def restore_epoch_end(trainer: pl.Trainer) -> None:
    _unset(trainer.fit_loop, "on_advance_end")


def share_evaluation_results(trainer: pl.Trainer, hooks: InstanceHooks, share: Callable[[Any], Any]) -> None:
    """``trainer.validate()`` / ``test()`` return ``share(results)``: the validation and test loops' ``run``
    (which hand Lightning its result dicts) wrapped in ``hooks``, whose ``restore`` undoes it."""
    for loop in (trainer.validate_loop, trainer.test_loop):
        hooks.wrap(loop, "run", transform=share)


def clear_predictions(trainer: pl.Trainer) -> None:
    """Empty the predict loop's prediction and batch-index lists in place (its private ``_predictions``,
    of which ``predictions`` is a view, and ``epoch_batch_indices``): ``trainer.predict`` returns them and
    a prediction writer reads them."""
    loop = trainer.predict_loop
    for predictions in loop._predictions:
        predictions.clear()
    for indices in loop.epoch_batch_indices:
        indices.clear()


# ---------------------------------------------------------------------- callbacks
# BaseFinetuning's hooks that look parameters up in the optimizers' param groups and add groups there
FINETUNING_HOOKS = ("on_fit_start", "on_train_epoch_start")
_ABSENT = object()


class _RunIn:
    """A callback's hook run by ``runner(hook, *args, **kwargs)`` for one run; ``previous`` is the callback's
    own instance attribute it stands in for, if any. Pickles as the hook alone."""

    def __init__(self, hook: Callable[..., Any], runner: Callable[..., Any], previous: Any) -> None:
        functools.update_wrapper(self, hook)  # Lightning's is_overridden follows __wrapped__
        self.hook, self.runner, self.previous = hook, runner, previous

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.runner(self.hook, *args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_itself, (self.hook,))


def _itself(hook: Callable[..., Any]) -> Callable[..., Any]:
    return hook


def run_finetuning_hooks_in(callbacks: Sequence[pl.Callback], runner: Callable[..., Any]) -> None:
    """Replace the :data:`FINETUNING_HOOKS` of every ``BaseFinetuning`` among ``callbacks`` for the run by
    ``runner(hook, *args, **kwargs)``: those hooks find parameters in the optimizers' param groups (by name
    for their checkpoint state, by value to skip ones already there) and add groups with what they
    unfreeze, so a strategy whose param groups hold flat slices runs them with the module's parameters in
    view and takes in what they added. :func:`restore_finetuning_hooks` gives the callbacks theirs back."""
    for callback in callbacks:
        if not isinstance(callback, BaseFinetuning):
            continue
        for name in FINETUNING_HOOKS:
            if isinstance(callback.__dict__.get(name), _RunIn):
                continue
            previous = callback.__dict__.get(name, _ABSENT)
            setattr(callback, name, _RunIn(getattr(callback, name), runner, previous))


def restore_finetuning_hooks(trainer: pl.Trainer | None) -> None:
    """The callbacks of ``trainer`` run their own hooks again (a user's instance attribute is put back)."""
    for callback in trainer.callbacks if trainer is not None else ():
        for name in FINETUNING_HOOKS:
            hook = callback.__dict__.get(name)
            if isinstance(hook, _RunIn):
                if hook.previous is _ABSENT:
                    _unset(callback, name)
                else:
                    callback.__dict__[name] = hook.previous


# ---------------------------------------------------------------------- logging
@contextmanager
def step_values_over_micro_batches(results: Any) -> Iterator[None]:
    """Around one training step's micro-batches on the stage that runs the user's step (``results``: the
    trainer's :func:`result_collection`; ``None`` leaves logging alone), a value logged ``on_step`` becomes
    the batch's, not its last micro-batch's.

    Each ``self.log`` call reaches the collection once per micro-batch, and Lightning keeps the last call's
    value as the step's. The collection's ``update_metrics`` is replaced for the step to note every tensor
    value logged with ``on_step=True``; afterwards each such metric's step value (its private
    ``_forward_cache``) becomes what its ``reduce_fx`` makes of the micro-batches' values (the mean weighted
    as Lightning weighs the epoch's mean, the max, min or sum), as one process logging the whole batch would
    see. Values logged ``on_epoch`` accumulate per call, as Lightning accumulates them; torchmetrics objects
    keep their own step value (their ``forward`` on the last micro-batch)."""
    if results is None or not hasattr(results, "update_metrics"):
        yield
        return
    original = results.update_metrics
    logged: dict[str, list[tuple[torch.Tensor, int]]] = {}

    def noting(key: str, value: Any, batch_size: int) -> None:
        original(key, value, batch_size)
        metric = results[key]
        if metric.is_tensor and metric.meta.on_step:
            logged.setdefault(key, []).append((metric._forward_cache, batch_size))

    _set_for_run(results, "update_metrics", noting)
    try:
        yield
    finally:
        _unset(results, "update_metrics")
    for key, values in logged.items():
        if len(values) > 1:
            _set_step_value(results[key], values)


def _set_step_value(metric: Any, values: list[tuple[torch.Tensor, int]]) -> None:
    stacked = torch.stack([value for value, _ in values])
    meta = metric.meta
    if meta.is_mean_reduction:
        weights = torch.tensor([size for _, size in values], dtype=stacked.dtype, device=stacked.device)
        weights = weights.reshape(-1, *([1] * (stacked.dim() - 1)))
        step = (stacked * weights).sum(0) / weights.sum()
    elif meta.is_max_reduction:
        step = stacked.max(0).values
    elif meta.is_min_reduction:
        step = stacked.min(0).values
    elif meta.is_sum_reduction:
        step = stacked.sum(0)
    else:  # a custom reduction: Lightning keeps the last value
        return
    metric._forward_cache = step
    if not meta.on_epoch:  # Lightning's update keeps the step value as the value too
        metric.value = step


# ---------------------------------------------------------------------- checkpoint restoring
def run_arguments(trainer: pl.Trainer) -> tuple[Any, bool | None] | None:
    """``(ckpt_path, weights_only)`` of the ``Trainer._run`` that is setting the strategy up, read from that
    call's frame: Lightning keeps the checkpoint's path only as an argument of the private ``_run`` until it
    restores, and ``weights_only`` nowhere else. ``None`` when there is no such call."""
    run_code = pl.Trainer._run.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is run_code and frame.f_locals.get("self") is trainer:
            return frame.f_locals.get("ckpt_path"), frame.f_locals.get("weights_only")
        frame = frame.f_back
    return None


def restore_modules_and_callbacks(trainer: pl.Trainer, ckpt_path: Any, weights_only: bool | None) -> None:
    """The checkpoint connector's private ``_restore_modules_and_callbacks``: the module, the datamodule and
    the callbacks from ``ckpt_path``, the step ``Trainer._run`` takes before ``on_fit_start`` for ``ddp``."""
    trainer._checkpoint_connector._restore_modules_and_callbacks(ckpt_path, weights_only)


# ---------------------------------------------------------------------- checkpoint files
_local_writer = threading.local()  # this thread's writer of local checkpoint files, while one is active


@contextmanager
def local_checkpoint_writes(write: Callable[[dict[str, Any], str], None]) -> Iterator[None]:
    """While active on this thread, ``TorchCheckpointIO.save_checkpoint`` writes a checkpoint to a local path
    with ``write(checkpoint, local_path)`` in place of Lightning's ``_atomic_save`` (whose fsspec
    transaction stages the file in ``TMPDIR``); remote paths, and other threads, keep Lightning's.

    ``TorchCheckpointIO.save_checkpoint`` itself still runs, checks ``storage_options`` and creates the
    directory, so code that patches or wraps it (Lightning's own tests mock it) sees the call it expects.
    Lightning's ``torch_io`` module reads ``_atomic_save`` as a module global at each save: it is replaced
    once by a function that hands local paths to the active writer and passes everything else on."""
    from lightning.fabric.plugins.io import torch_io

    if not getattr(torch_io._atomic_save, "_hands_local_paths_over", False):
        lightning_atomic_save = torch_io._atomic_save

        def _atomic_save(checkpoint: dict[str, Any], filepath: Any) -> None:
            writer = getattr(_local_writer, "write", None)
            if writer is not None:
                import fsspec
                from fsspec.implementations.local import LocalFileSystem

                fs, local_path = fsspec.core.url_to_fs(str(filepath))
                if isinstance(fs, LocalFileSystem):
                    writer(checkpoint, local_path)
                    return
            lightning_atomic_save(checkpoint, filepath)

        _atomic_save._hands_local_paths_over = True  # type: ignore[attr-defined]
        torch_io._atomic_save = _atomic_save
    previous = getattr(_local_writer, "write", None)
    _local_writer.write = write
    try:
        yield
    finally:
        _local_writer.write = previous
