"""Run under torchrun (2 processes) with argv ``OUT STRATEGY``: rank 0 receives SIGTERM (Lightning's flag)
in the step of batch 2; every rank must leave the fit with ``SIGTERMException`` before batch 3 trains,
as under ``ddp``. Each rank writes ``OUT.<rank>``: the exception's name, the steps trained, its losses."""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import HierPipelineStrategy


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):  # noqa: ANN001, ANN201
        self.losses.append(float(outputs["loss"]))
        if batch_idx == 2 and self.trainer.global_rank == 0:
            self.trainer._signal_connector.received_sigterm = True  # what its SIGTERM handler sets

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    out, kind = Path(sys.argv[1]), sys.argv[2]
    pl.seed_everything(0, verbose=False)
    timeout = timedelta(seconds=60)
    pipeline = kind == "hier_pipeline"
    strategy = HierPipelineStrategy(timeout=timeout) if pipeline else DDPStrategy(timeout=timeout)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=8, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randn(64, 1, generator=generator))
    model = Regressor()
    raised = None
    try:
        trainer.fit(model, DataLoader(data, batch_size=8))
    except BaseException as err:  # noqa: BLE001
        raised = type(err).__name__ if type(err).__name__ == "SIGTERMException" else repr(err)
    result = {"raised": raised, "global_step": trainer.global_step, "losses": model.losses}
    Path(f"{out}.{trainer.global_rank}").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
