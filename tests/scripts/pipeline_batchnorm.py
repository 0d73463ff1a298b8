"""Run under torchrun: train ``BatchNormChain`` under hier_pipeline with one activation policy for every
layer; rank 0 writes the trained module's state (parameters and BatchNorm buffers) to OUT.

    pipeline_batchnorm.py POLICY OUT

The test compares it with one process accumulating the same micro-batches (each micro-batch's forward
runs once there, so each BatchNorm updates its running statistics once per micro-batch).
"""

from __future__ import annotations

import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

MICRO_BATCHES = 2
BATCH = 16
STEPS = 3


class BatchNormChain(pl.LightningModule):
    """Linear, BatchNorm, ReLU twice, then a Linear head; float64 SGD with momentum."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.norm1 = nn.Linear(6, 12), nn.BatchNorm1d(12)
        self.mid, self.norm2 = nn.Linear(12, 12), nn.BatchNorm1d(12, momentum=None)  # cumulative average
        self.out = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm1(self.inp(x)))
        return self.out(torch.relu(self.norm2(self.mid(h))))

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def batch_norm_loader(batch_size: int) -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH * STEPS, 6, generator=generator, dtype=torch.float64) * 3 + 1
    y = torch.randint(0, 3, (BATCH * STEPS,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def trainer(**kwargs) -> pl.Trainer:  # noqa: ANN003
    return pl.Trainer(
        accelerator="cpu", max_steps=STEPS, precision="64-true", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kwargs,
    )  # fmt: skip


def main() -> None:
    from lightning_hier import HierPipelineStrategy

    policy, out = sys.argv[1], sys.argv[2]
    model = BatchNormChain()
    strategy = HierPipelineStrategy(
        partition="uniform", rebalance="never", micro_batches=MICRO_BATCHES, activation_policy=policy
    )
    trainer(devices=2, strategy=strategy).fit(model, train_dataloaders=batch_norm_loader(BATCH))
    if torch.distributed.get_rank() == 0:
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, out)


if __name__ == "__main__":
    main()
