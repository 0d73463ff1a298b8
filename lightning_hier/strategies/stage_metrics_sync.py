"""``StageMetricsSync``: the last pipeline stage's logged metrics, copied to every stage, for one run.

Only the last stage (rank 0) computes the loss and the metrics, but ``ModelCheckpoint``,
``EarlyStopping`` and ``ReduceLROnPlateau`` read them on every rank. The copy is taken right after the
LightningModule's own ``on_train_epoch_end`` / ``on_validation_epoch_end``, which Lightning calls
after the callbacks' plain hooks and before the monitoring callbacks (train) or ``on_validation_end``
(validation): metrics the module logs in those hooks are included.

It wraps those module hooks for the run instead of adding a callback: ``trainer.callbacks`` stays the
user's list during the run as well as after it, as under ``ddp`` (a callback inserted first in the
list would show a user's callback that captured the list one more entry, and would take the copy
before the module's ``on_train_epoch_end``, so a metric logged there would be missing on the other
stages). Lightning glue: it lives beside the strategy, which imports no callback module.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import BasePredictionWriter

from lightning_hier.pipeline.object_wire import from_wire, to_wire
from lightning_hier.strategies.instance_hooks import InstanceHooks
from lightning_hier.strategies.lightning_patches import clear_predictions, share_evaluation_results
from lightning_hier.topology import control_group


class StageMetricsSync:
    """Installed by :class:`~lightning_hier.strategies.hier_pipeline.HierPipelineStrategy` for a run:
    copies rank 0's logged metrics to every stage at epoch ends and keeps predictions on the last stage
    only (the others have none: a ``None`` per batch)."""

    def __init__(
        self, trainer: pl.Trainer, module: pl.LightningModule, last_stage: bool | None = None
    ) -> None:
        self.trainer = trainer
        # where predictions are kept: the last stage of each pipeline replica (default: rank 0)
        self.last_stage = trainer.global_rank == 0 if last_stage is None else last_stage
        self._module_hooks = InstanceHooks()
        self._writer_hooks = InstanceHooks()
        self._module_hooks.wrap(module, "on_train_epoch_end", after=self._sync)
        self._module_hooks.wrap(module, "on_validation_epoch_end", after=self._sync_unless_sanity)
        if not self.last_stage:
            self._module_hooks.wrap(module, "on_predict_epoch_end", before=self._drop_predictions)
        # trainer.validate() / test() return the last stage's results on every rank, as under ddp each
        # rank gets a result dict with every logged key (otherwise the other stages get empty dicts, and a
        # script reading metrics[0]["val_loss"] on every rank fails there)
        share_evaluation_results(trainer, self._module_hooks, self._share_results)

    def remove(self) -> None:
        self._writer_hooks.restore()
        self._module_hooks.restore()

    # ------------------------------------------------------------------ metrics
    def _from_last_stage(self, value: Any) -> Any:
        """Rank 0's (the last stage's) ``value`` on every rank (a broadcast on the host group)."""
        trainer = self.trainer
        if trainer.world_size < 2 or not dist.is_initialized():
            return value
        payload: list[Any] = [to_wire(value) if trainer.global_rank == 0 else None]
        dist.broadcast_object_list(payload, src=0, group=control_group())
        return value if trainer.global_rank == 0 else from_wire(payload[0])

    def _sync(self) -> None:
        metrics = self.trainer.callback_metrics
        last_stage = self._from_last_stage(dict(metrics))
        if self.trainer.global_rank != 0:
            metrics.update(last_stage)

    def _share_results(self, results: Any) -> Any:
        return self._from_last_stage(results)

    def _sync_unless_sanity(self) -> None:
        if not self.trainer.sanity_checking:  # no callback acts on the sanity check's metrics
            self._sync()

    # ------------------------------------------------------------------ predictions
    def on_predict_start(self) -> None:
        """A stage other than the last: its writers write nothing per batch, and empty lists at the
        epoch's end (the last stage writes every prediction once)."""
        if self.last_stage:
            return
        for callback in self.trainer.callbacks:
            if isinstance(callback, BasePredictionWriter):
                self._writer_hooks.wrap(callback, "on_predict_batch_end", skip=True)
                self._writer_hooks.wrap(callback, "on_predict_epoch_end", before=self._drop_predictions)

    def on_predict_end(self) -> None:
        self._writer_hooks.restore()

    def _drop_predictions(self) -> None:
        """Empty this stage's prediction lists in place: ``trainer.predict`` returns them (an empty list
        here, as ``ddp`` returns each rank's share), and a writer reads them."""
        clear_predictions(self.trainer)
