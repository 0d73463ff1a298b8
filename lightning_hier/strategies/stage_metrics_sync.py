"""``StageMetricsSync``: the last pipeline stage's logged metrics, copied to every stage.

Installed by :class:`~lightning_hier.strategies.hier_pipeline.HierPipelineStrategy` (Lightning
glue: it lives beside the strategy, so the strategy imports no callback module).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import BasePredictionWriter, Callback

from lightning_hier.pipeline.object_wire import from_wire, to_wire
from lightning_hier.topology import control_group


def _no_batch_write(*args: Any, **kwargs: Any) -> None:
    """Stands in for a prediction writer's per-batch hook on a stage that computes no prediction."""


class StageMetricsSync(Callback):
    """Copies the last stage's (rank 0's) logged metrics to every stage process; empties the other
    stages' prediction lists.

    Only the last stage computes the loss and the metrics, but ``ModelCheckpoint`` and
    ``EarlyStopping`` read them on every rank; ``HierPipelineStrategy`` installs this callback
    first in the list so they see the same values everywhere.
    """

    def _sync(self, trainer: pl.Trainer) -> None:
        if trainer.world_size < 2 or not dist.is_initialized():
            return
        metrics = trainer.callback_metrics
        payload: list[Any] = [to_wire(dict(metrics)) if trainer.global_rank == 0 else None]
        dist.broadcast_object_list(payload, src=0, group=control_group())
        if trainer.global_rank != 0:
            metrics.update(from_wire(payload[0]))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._sync(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sync(trainer)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A batch-interval ``BasePredictionWriter`` writes on the last stage only: the others have no
        prediction (a ``None`` per batch), and the last stage writes every one of them."""
        if trainer.global_rank == 0:
            return
        for callback in trainer.callbacks:
            if isinstance(callback, BasePredictionWriter) and callback.interval.on_batch:
                callback.on_predict_batch_end = _no_batch_write  # type: ignore[method-assign]

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for callback in trainer.callbacks:
            if isinstance(callback, BasePredictionWriter):
                callback.__dict__.pop("on_predict_batch_end", None)

    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Only the last stage (rank 0) computes predictions; the other stages' lists (a ``None`` per
        batch) are emptied here, before any ``BasePredictionWriter`` reads them. A writer on every rank
        then writes the pipeline's predictions once, from rank 0, and ``trainer.predict`` returns them
        there and an empty list elsewhere, as ``ddp`` returns each rank's share."""
        if trainer.global_rank != 0:
            loop = trainer.predict_loop
            # Lightning keeps them in these attributes (the writer reads `predictions`, a view of them)
            loop._predictions = [[] for _ in loop._predictions]
            loop.epoch_batch_indices = [[] for _ in loop.epoch_batch_indices]
