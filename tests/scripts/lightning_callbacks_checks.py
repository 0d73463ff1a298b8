"""Run under torchrun (2 processes): Lightning's trainer features that drive a fit from outside the
strategy give the reference's result under each strategy.

``lightning_callbacks_checks.py OUT_DIR``; rank 0 writes ``OUT_DIR/results.json``: per strategy (``ddp``,
the reference, first) and per scenario the numbers to compare, or the error the scenario raised.

``hier_sliced`` and ``hier_bsp`` (in lockstep) are compared with ``ddp`` as the user runs it (Lightning
injects its shuffling ``DistributedSampler``). ``hier_pipeline``'s 2 stages are one data-parallel replica
that reads the user's loader in its order, so its reference is ``ddp_user_shards``: ``ddp`` without the
injected sampler, each rank reading every second sample (``r, r + 2, ...``) in batches of 4. The model is a
mean-loss MLP without batch statistics, so such a step takes the gradient of the same 8 samples as the
pipeline's batch of 8, and the validation mean over both ranks is the mean over all samples.

Scenarios:

- ``early_stopping``: ``EarlyStopping`` on the validation loss (logged with ``sync_dist``) stops the fit,
  ``LearningRateMonitor`` records the per-epoch ``StepLR`` rates through a ``CSVLogger``.
- ``accumulation_schedule``: ``GradientAccumulationScheduler`` accumulates 1, then 2 batches.
- ``reload_dataloaders``: ``reload_dataloaders_every_n_epochs=1`` with data that depends on the epoch.
- ``overfit_batches``: ``overfit_batches=2``.
- ``lr_find``: ``Tuner.lr_find`` (its fit restores the model afterwards): the losses it recorded.
- ``best_checkpoint``: validation every second epoch, ``ModelCheckpoint`` keeps the best by validation
  loss, then ``validate`` and ``test`` with ``ckpt_path="best"``.
- ``barebones``: ``Trainer(barebones=True)``.
- ``metrics``: torchmetrics objects logged in training and validation steps, and ``validate`` after.
- ``csv_logger``: the training loss logged per step and per epoch (``sync_dist``), the validation loss,
  and the rows a ``CSVLogger`` wrote on rank 0 with ``log_every_n_steps=1``.
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torchmetrics
from lightning.pytorch.callbacks import (
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
)
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.tuner import Tuner
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import HierBSPStrategy, HierPipelineStrategy, HierSlicedStrategy

sys.path.insert(0, str(Path(__file__).parent))
from models import reported  # noqa: E402

STRATEGIES: dict[str, Callable[[], Any]] = {
    "ddp": lambda: "ddp",
    "ddp_user_shards": lambda: "ddp",
    "hier_sliced": lambda: HierSlicedStrategy(devices_per_node=2),
    "hier_bsp": lambda: HierBSPStrategy(superstep=1, max_staleness=0, devices_per_node=2),
    "hier_pipeline": lambda: HierPipelineStrategy(micro_batches=2, rebalance="never"),
}
SAMPLES, PER_RANK_BATCH = 64, 4


class Net(pl.LightningModule):
    """Linear-tanh-linear regression; its loaders' batch size follows the strategy (see the docstring)."""

    def __init__(self, loading: Loading, epoch_dependent_data: bool = False, lr: float = 0.05) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        self.loading, self.epoch_dependent_data, self.lr = loading, epoch_dependent_data, lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.l1_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}

    def _data(self, seed: int) -> DataLoader:
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(SAMPLES, 8, generator=generator)
        if self.loading.own_shard:
            x = x[dist.get_rank() :: dist.get_world_size()]
        return DataLoader(TensorDataset(x, torch.sin(x[:, :2]) * 2), batch_size=self.loading.batch_size)

    def train_dataloader(self) -> DataLoader:
        return self._data(self.trainer.current_epoch if self.epoch_dependent_data else 0)

    def val_dataloader(self) -> DataLoader:
        return self._data(100)

    def test_dataloader(self) -> DataLoader:
        return self._data(200)


class WithMetrics(Net):
    """Logs torchmetrics objects (synchronised by torchmetrics itself at the epoch's end, on every rank)."""

    def __init__(self, loading: Loading) -> None:
        super().__init__(loading)
        self.train_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=2, average="micro")
        self.val_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=2, average="micro")
        self.val_mse = torchmetrics.MeanSquaredError()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        self.train_accuracy(out.argmax(1), (y[:, 0] > 0).long())
        self.log("train_accuracy", self.train_accuracy, on_step=False, on_epoch=True)
        return nn.functional.mse_loss(out, y)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        out = self(x)
        self.val_accuracy(out.argmax(1), (y[:, 0] > 0).long())
        self.val_mse(out, y)
        self.log("val_accuracy", self.val_accuracy)
        self.log("val_mse", self.val_mse)


class LogsItsLoss(Net):
    """Logs the training loss per step and per epoch, synchronised over the ranks."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss


@dataclass(frozen=True)
class Loading:
    """How a strategy's run reads the data: batch size, and whether each rank loads its own shard
    (then Lightning's distributed sampler is off)."""

    batch_size: int
    own_shard: bool = False

    @staticmethod
    def of(strategy: str) -> Loading:
        if strategy == "hier_pipeline":
            return Loading(2 * PER_RANK_BATCH)
        return Loading(PER_RANK_BATCH, own_shard=strategy == "ddp_user_shards")


def parameters(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def trainer(strategy: Any, loading: Loading, root: Path, **kwargs: Any) -> pl.Trainer:
    options = dict(
        accelerator="cpu", devices=2, strategy=strategy, default_root_dir=root, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        use_distributed_sampler=not loading.own_shard,
    )  # fmt: skip
    return pl.Trainer(**{**options, **kwargs})


def early_stopping(strategy: Any, loading: Loading, root: Path) -> dict[str, Any]:
    monitor = LearningRateMonitor(logging_interval="epoch")
    stop = EarlyStopping("val_loss", patience=1, min_delta=0.02)
    logger = CSVLogger(root / "logs")
    run = trainer(strategy, loading, root, max_epochs=30, callbacks=[stop, monitor], logger=logger)
    model = Net(loading, lr=0.2)
    run.fit(model)
    return {
        "stopped_epoch": stop.stopped_epoch,
        "epochs": run.current_epoch,
        "rates": monitor.lrs["lr-SGD"],
        "params": parameters(model),
    }


def accumulation_schedule(strategy: Any, loading: Loading, root: Path) -> dict[str, Any]:
    schedule = GradientAccumulationScheduler({0: 1, 2: 2})
    run = trainer(strategy, loading, root, max_epochs=4, callbacks=[schedule])
    model = Net(loading)
    run.fit(model)
    return {"global_step": run.global_step, "params": parameters(model)}


def reload_dataloaders(strategy: Any, loading: Loading, root: Path) -> dict[str, Any]:
    run = trainer(
        strategy, loading, root, max_epochs=3, reload_dataloaders_every_n_epochs=1, limit_val_batches=0
    )
    model = Net(loading, epoch_dependent_data=True)
    run.fit(model)
    return {"global_step": run.global_step, "params": parameters(model)}


def overfit_batches(strategy: Any, loading: Loading, root: Path) -> dict[str, Any]:
    run = trainer(strategy, loading, root, max_epochs=3, overfit_batches=2)
    model = Net(loading)
    run.fit(model)
    return {"global_step": run.global_step, "params": parameters(model)}


def lr_find(strategy: Any, loading: Loading, root: Path) -> dict[str, Any]:
    model = Net(loading)
    before = parameters(model)
    finder = Tuner(trainer(strategy, loading, root, max_epochs=1)).lr_find(
        model, min_lr=1e-3, max_lr=1.0, num_training=8, early_stop_threshold=None
    )
    assert finder is not None
    return {
        "losses": finder.results["loss"],
        "rates": finder.results["lr"],
        "restored": parameters(model) == before,
    }


def best_checkpoint(strategy: Any, loading: Loading, root: Path) -> dict[str, Any]:
    """Validation every second epoch, the best checkpoint by validation loss, then ``validate`` and
    ``test`` from that checkpoint (``ckpt_path="best"``)."""
    saved = ModelCheckpoint(dirpath=root / "best", monitor="val_loss", save_top_k=1)
    run = trainer(
        strategy, loading, root, max_epochs=5, check_val_every_n_epoch=2, callbacks=[saved],
        enable_checkpointing=True,
    )  # fmt: skip
    model = Net(loading, lr=0.3)
    run.fit(model)
    validated = run.validate(model, ckpt_path="best", verbose=False)
    tested = run.test(model, ckpt_path="best", verbose=False)
    return {
        "best_score": float(saved.best_model_score),
        "best_epoch": int(Path(saved.best_model_path).stem.split("-")[0].split("=")[1]),
        "validated": validated[0]["val_loss"],
        "tested": tested[0]["test_loss"],
        "params": parameters(model),
    }


def barebones(strategy: Any, loading: Loading, root: Path) -> dict[str, Any]:
    run = trainer(strategy, loading, root, max_epochs=2, barebones=True)
    model = Net(loading)
    run.fit(model)
    return {"global_step": run.global_step, "params": parameters(model)}


def metrics(strategy: Any, loading: Loading, root: Path) -> dict[str, Any]:
    run = trainer(strategy, loading, root, max_epochs=2)
    model = WithMetrics(loading)
    run.fit(model)
    logged = {name: float(value) for name, value in run.callback_metrics.items()}
    return {**logged, "validated": run.validate(model, verbose=False)[0], "params": parameters(model)}


USER_METRICS = ("epoch", "train_loss_step", "train_loss_epoch", "val_loss")


def csv_logger(strategy: Any, loading: Loading, root: Path) -> dict[str, Any]:
    """What rank 0's ``CSVLogger`` wrote of the user's metrics, per step (``log_every_n_steps=1``)."""
    logger = CSVLogger(root / "logs", name="run", version=0)
    run = trainer(strategy, loading, root, max_epochs=2, logger=logger, log_every_n_steps=1)
    run.fit(LogsItsLoss(loading))
    if run.global_rank != 0:
        return {}
    by_step: dict[str, dict[str, float]] = {}  # the user's metrics (a strategy may add its own) per step
    with open(Path(logger.log_dir) / "metrics.csv") as file:
        for row in csv.DictReader(file):
            mine = {k: float(v) for k, v in row.items() if v != "" and k in USER_METRICS}
            if mine:
                by_step.setdefault(row["step"], {}).update(mine)
    return by_step


SCENARIOS = {
    "early_stopping": early_stopping,
    "accumulation_schedule": accumulation_schedule,
    "reload_dataloaders": reload_dataloaders,
    "overfit_batches": overfit_batches,
    "lr_find": lr_find,
    "best_checkpoint": best_checkpoint,
    "barebones": barebones,
    "metrics": metrics,
    "csv_logger": csv_logger,
}


def main() -> None:
    out = Path(sys.argv[1])
    results: dict[str, dict[str, Any]] = {}
    for name, make in STRATEGIES.items():
        loading = Loading.of(name)
        results[name] = {
            scenario: reported(run, make(), loading, out / name / scenario)
            for scenario, run in SCENARIOS.items()
        }
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
