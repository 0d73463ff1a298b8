"""Lightning callbacks the strategies cannot serve, refused before any process group exists.

- ``BaseFinetuning`` (``BackboneFinetuning`` and user subclasses), under every strategy of the package:
  it unfreezes modules during fit and hands their parameters to the optimizer with ``add_param_group``.
  The strategies shard the optimizer (``hier_sliced``, ``hier_bsp``) or split the model
  (``hier_pipeline``) over the parameters trainable at setup, so they cannot take new ones mid-fit;
  the callback would fail in its own bookkeeping (the optimizer's groups hold flat slices) or, under
  ``hier_bsp``, the new parameters would silently never be updated.
- ``StochasticWeightAveraging`` and ``WeightAveraging`` (``EMAWeightAveraging``), under ``hier_pipeline``:
  they copy the whole module before setup and average every parameter into that copy, while each
  pipeline process holds only its stage's parameters (the others are empty there), so the copy fails
  at the first averaging.
- ``ModelPruning``, under ``hier_pipeline``: it masks parameters every process holds only part of, and
  rewrites every checkpoint's state dict with its masks, which fails on the other stages' empty tensors.

Under ``hier_bsp`` a ``WeightAveraging`` that updates every step is served with a warning: it averages
the model each worker computed its step with, and the server's update of that step reaches the worker
at its next step (later with staleness), so the average trails ``ddp``'s by about a step. Averaging at
epoch ends (``StochasticWeightAveraging``, or ``should_update`` on ``epoch_idx``) sees the drained,
current model and matches ``ddp``.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BaseFinetuning, ModelPruning, StochasticWeightAveraging
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

try:
    from lightning.pytorch.callbacks import WeightAveraging
except ImportError:  # Lightning before 2.5 has no WeightAveraging
    WeightAveraging = None

AVERAGING: tuple[type, ...] = (StochasticWeightAveraging,) + ((WeightAveraging,) if WeightAveraging else ())


def refuse_unsupported_callbacks(module: pl.LightningModule | None, strategy: str) -> None:
    """Raise ``ValueError`` naming the first callback of the fit that ``strategy`` cannot serve."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return
    for callback in trainer.callbacks:
        name = type(callback).__name__
        if isinstance(callback, BaseFinetuning):
            raise ValueError(
                f"{name} unfreezes parameters during fit and adds them to the optimizer (add_param_group); "
                f"{strategy} builds its optimizer shards over the parameters trainable at setup and cannot "
                "take new ones mid-fit. Fine-tune in two fits: train with the backbone frozen, then load the "
                "weights into a second fit whose configure_optimizers includes the unfrozen parameters. "
                "(Lightning's ddp runs the callback, but does not all-reduce the gradients of parameters "
                "frozen when it wrapped the model, so their copies drift apart across processes.)"
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
        if WeightAveraging is not None and isinstance(callback, WeightAveraging) and strategy == "hier_bsp":
            rank_zero_warn(
                f"{name} under hier_bsp averages each worker's model at the end of its step, the model it "
                "computed that step with: the server's update of the step reaches the worker at its next "
                "step (later with max_staleness > 0), so the average trails ddp's by about a step. "
                "Averaging at epoch ends (should_update on epoch_idx, or StochasticWeightAveraging) sees "
                "the drained, current model."
            )
