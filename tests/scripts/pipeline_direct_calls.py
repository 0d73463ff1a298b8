"""Run under torchrun (2 processes): an autoencoder under ``hier_pipeline`` whose ``training_step`` calls
``self.encoder`` and ``self.decoder`` itself, with a ``forward`` that computes more than the encoder (so the
step's ``self.encoder(x)`` is not ``self(x)``). The stages cannot run it: the fit must fail with the reason on
the stage that called a layer it does not hold, and the other stage must end too (not wait)."""

from __future__ import annotations

from datetime import timedelta

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import HierPipelineStrategy


class SquashingAutoEncoder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
        self.decoder = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.encoder(x))  # not what the step's own self.encoder(x) gives

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        (x,) = batch
        z = self.encoder(x)
        return nn.functional.mse_loss(self.decoder(z), x)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    pl.seed_everything(0, verbose=False)
    strategy = HierPipelineStrategy(timeout=timedelta(seconds=60))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(SquashingAutoEncoder(), DataLoader(TensorDataset(torch.randn(64, 16)), batch_size=16))


if __name__ == "__main__":
    main()
