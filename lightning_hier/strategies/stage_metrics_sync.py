"""``StageMetricsSync``: the last pipeline stage's logged metrics, copied to every stage.

Installed by :class:`~lightning_hier.strategies.hier_pipeline.HierPipelineStrategy` (Lightning
glue: it lives beside the strategy, so the strategy imports no callback module).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_hier.topology import control_group


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
        payload: list[Any] = [
            {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in metrics.items()}
            if trainer.global_rank == 0
            else None
        ]
        dist.broadcast_object_list(payload, src=0, group=control_group())
        if trainer.global_rank != 0:
            metrics.update(payload[0])

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._sync(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sync(trainer)

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
