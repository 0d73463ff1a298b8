"""Lightning callbacks the strategies cannot serve, refused before any process group exists, and the
help ``hier_sliced`` gives the fine-tuning callbacks it serves.

- ``BaseFinetuning`` (``BackboneFinetuning`` and user subclasses), under ``hier_pipeline``: it unfreezes
  modules during fit and hands their parameters to the optimizer with ``add_param_group``, while the
  pipeline split the model over the parameters trainable at setup. ``hier_sliced`` serves it
  (:func:`show_user_param_groups`: the callback sees the module's parameters in the optimizer's groups,
  and what it unfreezes or adds is taken in when it returns); so does ``hier_bsp``, which takes new
  parameters in before the next step.
- ``StochasticWeightAveraging`` and ``WeightAveraging`` (``EMAWeightAveraging``), under ``hier_pipeline``:
  they copy the whole module before setup and average every parameter into that copy, while each
  pipeline process holds only its stage's parameters (the others are empty there), so the copy fails
  at the first averaging.
- ``ModelPruning``, under ``hier_pipeline``: it masks parameters every process holds only part of, and
  rewrites every checkpoint's state dict with its masks, which fails on the other stages' empty tensors.

Under ``hier_bsp`` off lockstep (``max_staleness`` > 0, a ``superstep`` duration or ``fill_idle``) a
``WeightAveraging`` is served with a warning: a worker goes on without waiting for the server's update
of its step, so the model it averages at the end of a step trails ``ddp``'s by about a step (more with
staleness), and workers take different numbers of steps. In lockstep (plain BSP) each worker takes the
stepped model before ``on_train_batch_end``, as ``ddp`` has it. Averaging at epoch ends
(``StochasticWeightAveraging``, or ``should_update`` on ``epoch_idx``) sees the drained, current model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BaseFinetuning, ModelPruning, StochasticWeightAveraging
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from lightning_hier.sliced.engine import HierSlicedEngine, take_in_new_parameters
from lightning_hier.strategies.lightning_patches import (
    attached_trainer,
    restore_finetuning_hooks,
    run_finetuning_hooks_in,
)

try:
    from lightning.pytorch.callbacks import WeightAveraging
except ImportError:  # Lightning before 2.5 has no WeightAveraging
    WeightAveraging = None

AVERAGING: tuple[type, ...] = (StochasticWeightAveraging,) + ((WeightAveraging,) if WeightAveraging else ())


def refuse_unsupported_callbacks(
    module: pl.LightningModule | None, strategy: str, lockstep: bool = False
) -> None:
    """Raise ``ValueError`` naming the first callback of the fit that ``strategy`` cannot serve.
    ``lockstep``: ``hier_bsp``'s workers take every stepped model before their next hook (no warning
    for per-step weight averaging)."""
    trainer = attached_trainer(module)
    if trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return
    for callback in trainer.callbacks:
        name = type(callback).__name__
        if isinstance(callback, BaseFinetuning) and strategy == "hier_pipeline":
            raise ValueError(
                f"{name} unfreezes parameters during fit and adds them to the optimizer (add_param_group); "
                "hier_pipeline splits the model into stages over the parameters trainable at setup and "
                "cannot take new ones mid-fit. Fine-tune under hier_sliced or hier_bsp (they take the "
                "parameters in when the callback adds them), or in two fits: train with the backbone frozen, "
                "then load the weights into a second fit whose configure_optimizers includes the unfrozen "
                "parameters."
            )
        if isinstance(callback, AVERAGING) and strategy == "hier_pipeline":
            raise ValueError(
                f"{name} averages a full copy of the module, but each hier_pipeline process holds only its "
                "stage's parameters. Use it with hier_sliced, hier_bsp or ddp (they keep the whole model "
                "on every process), or average the stage's parameters yourself with "
                "torch.optim.swa_utils.AveragedModel in a callback."
            )
        if isinstance(callback, ModelPruning) and strategy == "hier_pipeline":
            raise ValueError(
                f"{name} masks parameters by magnitude and writes its masks into every checkpoint, but each "
                "hier_pipeline process holds only its stage's parameters (the others are empty there). "
                "Prune under hier_sliced, hier_bsp or ddp, or prune the trained model after fit."
            )
        averages = WeightAveraging is not None and isinstance(callback, WeightAveraging)
        if averages and strategy == "hier_bsp" and not lockstep:
            rank_zero_warn(
                f"{name} under hier_bsp off lockstep averages each worker's model at the end of its step, "
                "before the server's update of that step has reached the worker (it goes on without "
                "waiting), so the average trails ddp's by about a step, and workers take different numbers "
                "of steps. Plain BSP (superstep=1, max_staleness=0) averages the stepped model as ddp "
                "does; averaging at epoch ends (should_update on epoch_idx, or StochasticWeightAveraging) "
                "sees the drained, current model."
            )


def show_user_param_groups(
    callbacks: Sequence[pl.Callback], engines: Callable[[], Sequence[HierSlicedEngine]]
) -> None:
    """For one run: the ``BaseFinetuning`` hooks that look parameters up in the optimizers' param groups (by
    name for their checkpoint state, by value to skip ones already there) run while every engine of
    ``engines()`` shows the module's parameters there in place of its flat slices; what a hook unfroze or
    added is taken in when it returns (a collective over the node where anything changed: the callback
    runs alike on every rank). :func:`stop_showing_user_param_groups` puts the hooks back."""

    def run(hook: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        running = engines()
        with ExitStack() as stack:
            for engine in running:
                stack.enter_context(engine.user_param_groups(take_in=False))
            result = hook(*args, **kwargs)
        take_in_new_parameters(running)
        return result

    run_finetuning_hooks_in(callbacks, run)


def stop_showing_user_param_groups(module: pl.LightningModule | None) -> None:
    """Give the callbacks of ``module``'s trainer their own hooks back."""
    restore_finetuning_hooks(attached_trainer(module))
