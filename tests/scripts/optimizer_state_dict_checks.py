"""Run under torchrun (2 processes, one node): what the user's optimizer object answers to ``state_dict()``
and ``load_state_dict()`` during a fit, under Lightning's ``ddp`` (the reference) and ``hier_sliced``.

``optimizer_state_dict_checks.py OUT`` writes, per strategy and rank, ``OUT/<strategy>-rank<r>.pt``: the
optimizer's ``state_dict()`` in ``on_train_epoch_end`` of a 1-epoch fit (which then saves
``OUT/<strategy>/epoch1.ckpt``), in ``on_train_start`` of a fit resumed from that checkpoint, right after
``optimizer.load_state_dict(checkpoint["optimizer_states"][0])`` in ``on_train_start`` of a fresh fit, the
parameters that fit trained, and how many consolidations one checkpoint save ran.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import HierSlicedStrategy
from lightning_hier.sliced.sharded_optim import OptimizerSharding

F64 = torch.float64


class AdamModule(pl.LightningModule):
    """Float64 MLP (a 32-element bias among its parameters), Adam with two param groups and a StepLR."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 32, dtype=F64), nn.Tanh(), nn.Linear(32, 1, dtype=F64))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(
            [
                {"params": self.net[0].parameters()},
                {"params": self.net[2].parameters(), "lr": 0.02, "weight_decay": 0.1},
            ],
            lr=0.01,
            betas=(0.8, 0.95),
        )
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]


class Record(pl.Callback):
    """Deep copies of ``trainer.optimizers[0].state_dict()`` (ddp's holds the live state tensors)."""

    def __init__(self, records: dict[str, Any], save_to: Path | None = None, load: Any = None) -> None:
        self.records = records
        self.save_to = save_to
        self.load = load

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        if self.load is not None:
            optimizer.load_state_dict(self.load)
            self.records["after_load"] = copy.deepcopy(optimizer.state_dict())
        elif trainer.current_epoch > 0:
            self.records["on_train_start"] = copy.deepcopy(optimizer.state_dict())

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.save_to is None:
            return
        self.records["epoch_end"] = copy.deepcopy(trainer.optimizers[0].state_dict())
        # the LightningOptimizer that self.optimizers() returns answers as the object it wraps
        self.records["wrapper_epoch_end"] = copy.deepcopy(pl_module.optimizers().state_dict())
        calls = _count_consolidations()
        trainer.save_checkpoint(self.save_to)
        self.records["consolidations_per_save"] = _count_consolidations() - calls


CONSOLIDATIONS = [0]


def _count_consolidations() -> int:
    return CONSOLIDATIONS[0]


def _counting(method: Any) -> Any:
    def counted(self: OptimizerSharding) -> dict[str, Any]:
        CONSOLIDATIONS[0] += 1
        return method(self)

    return counted


def fit(
    strategy: Any, epochs: int, callback: Record, ckpt_path: str | None = None, weights: Any = None
) -> AdamModule:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 6, generator=g, dtype=F64), torch.randn(64, 1, generator=g, dtype=F64)
    model = AdamModule()
    if weights is not None:
        model.load_state_dict(weights)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=[callback],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8), ckpt_path=ckpt_path)
    return model


def run(name: str, make_strategy: Any, out: Path) -> None:
    records: dict[str, Any] = {}
    ckpt = out / name / "epoch1.ckpt"
    fit(make_strategy(), 1, Record(records, save_to=ckpt))
    fit(make_strategy(), 2, Record(records), ckpt_path=str(ckpt))
    saved = torch.load(ckpt, weights_only=False)
    try:
        loads = Record(records, load=saved["optimizer_states"][0])
        model = fit(make_strategy(), 1, loads, weights=saved["state_dict"])
        records["loaded_fit_params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    except Exception as error:  # noqa: BLE001 (reported to the test, which names it)
        records["load_error"] = f"{type(error).__name__}: {error}"
    torch.save(records, out / f"{name}-rank{dist.get_rank()}.pt")
    dist.barrier()


def main() -> None:
    out = Path(sys.argv[1])
    OptimizerSharding.consolidated_state_dict = _counting(OptimizerSharding.consolidated_state_dict)
    run("ddp", lambda: "ddp", out)
    # small buckets: several of them, each cut between the two ranks across parameters
    run("hier_sliced", lambda: HierSlicedStrategy(bucket_cap_mb=0.001), out)


if __name__ == "__main__":
    main()
