"""Lightning's fine-tuning callbacks, refused before any process group exists.

``BaseFinetuning`` callbacks (``BackboneFinetuning`` and user subclasses) unfreeze modules during fit
and hand their parameters to the optimizer with ``add_param_group``. The package's strategies shard
the optimizer (``hier_sliced``, ``hier_bsp``) or split the model (``hier_pipeline``) over the
parameters trainable at setup, so they cannot take new ones mid-fit; the callback would fail in its own
bookkeeping (the optimizer's groups hold flat slices) or, under ``hier_bsp``, the new parameters would
silently never be updated.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.trainer.states import TrainerFn


def refuse_finetuning_callbacks(module: pl.LightningModule | None, strategy: str) -> None:
    """Raise ``ValueError`` naming the first ``BaseFinetuning`` callback of the fit, if any."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return
    found = [type(cb).__name__ for cb in trainer.callbacks if isinstance(cb, BaseFinetuning)]
    if found:
        raise ValueError(
            f"{found[0]} unfreezes parameters during fit and adds them to the optimizer (add_param_group); "
            f"{strategy} builds its optimizer shards over the parameters trainable at setup and cannot take "
            "new ones mid-fit. Fine-tune in two fits: train with the backbone frozen, then load the weights "
            "into a second fit whose configure_optimizers includes the unfrozen parameters. (Lightning's ddp "
            "runs the callback, but does not all-reduce the gradients of parameters frozen when it wrapped "
            "the model, so their copies drift apart across processes.)"
        )
