"""Run under torchrun (2 processes, one node): a fit that raises on every rank, then a second ``fit`` of the
same Trainer and module, whose ``configure_optimizers`` returns the same Adam object both times.

``refit_checks.py OUT`` runs it under Lightning's ``ddp`` (the reference), ``hier_sliced`` (the optimizer
sharded) and ``hier_sliced`` with ``shard_optimizer=False`` (kept whole on every rank); rank 0 writes ``OUT``
(JSON): per strategy, the error of the first fit, the parameters and the optimizer's state after the
second."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import HierSlicedStrategy


class RaisesOnce(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        self.optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        self.raise_at = 2  # the first fit raises at its third batch, after two steps

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        if batch_idx == self.raise_at:
            self.raise_at = -1
            raise ValueError("planned")
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer


def run(strategy: object) -> dict:
    data = TensorDataset(*torch.randn(2, 64, 8, generator=torch.Generator().manual_seed(1)).unbind(0))
    data = TensorDataset(data.tensors[0], data.tensors[1][:, :2])
    model = RaisesOnce()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=6, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    error = None
    try:
        trainer.fit(model, DataLoader(data, batch_size=4))
    except ValueError as caught:
        error = str(caught)
    trainer.fit(model, DataLoader(data, batch_size=4))
    state = model.optimizer.state_dict()
    entries = [state["state"][index] for index in sorted(state["state"])]
    return {
        "error": error,
        "params": [p.detach().flatten().tolist() for p in model.parameters()],
        "steps": [float(entry["step"]) for entry in entries],
        "exp_avg": [entry["exp_avg"].flatten().tolist() for entry in entries],
    }


def main() -> None:
    out = Path(sys.argv[1])
    results = {
        "reference": run("ddp"),
        "hier_sliced": run(HierSlicedStrategy(devices_per_node=2)),
        "hier_sliced_whole": run(HierSlicedStrategy(devices_per_node=2, shard_optimizer=False)),
    }
    if torch.distributed.get_rank() == 0:
        out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
