"""Run under torchrun (2 processes): a BatchNorm model trained by Lightning's ``ddp`` and by ``hier_sliced``
alike (float64, gradient accumulation over 2 batches, validation every 3 batches and the sanity check), each
rank reading its own shard, so the ranks' running statistics differ until rank 0's are broadcast.

    sliced_buffers.py OUT_DIR

Each rank writes ``OUT_DIR/{strategy}_rank{rank}.pt``: after every training batch its parameters and
buffers, and the loss of every validation batch (its own, not averaged over the ranks)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import HierSlicedStrategy


class NormNet(pl.LightningModule):
    """Linear, BatchNorm, ReLU, Linear in float64; validation losses kept per batch."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(6, 12), nn.BatchNorm1d(12), nn.Linear(12, 3)
        self.double()
        self.val_losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_losses.append(nn.functional.cross_entropy(self(batch[0]), batch[1]).detach().clone())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.5)


class Trace(pl.Callback):
    """This rank's parameters and buffers after every training batch."""

    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: NormNet, *args: Any) -> None:
        self.states.append({k: v.detach().clone() for k, v in pl_module.state_dict().items()})


def data(n: int, seed: int) -> TensorDataset:
    """Rows whose scale and offset grow along the data set: each rank's shard has other statistics."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    x = x * torch.linspace(0.5, 3.0, n, dtype=torch.float64)[:, None] + torch.linspace(-2, 2, n)[:, None]
    return TensorDataset(x, torch.randint(0, 3, (n,), generator=g))


def main() -> None:
    out = Path(sys.argv[1])
    strategies = {"ddp": lambda: "ddp", "hier_sliced": lambda: HierSlicedStrategy()}
    for name, make in strategies.items():
        pl.seed_everything(0)
        model, trace = NormNet(), Trace()
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy=make(), max_epochs=2, accumulate_grad_batches=2,
            val_check_interval=3, limit_val_batches=2, num_sanity_val_steps=2, callbacks=[trace],
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(
            model,
            train_dataloaders=DataLoader(data(56, 1), batch_size=4),  # 7 batches per rank and epoch
            val_dataloaders=DataLoader(data(16, 2), batch_size=4),
        )
        torch.save(
            {"states": trace.states, "val_losses": model.val_losses},
            out / f"{name}_rank{dist.get_rank()}.pt",
        )


if __name__ == "__main__":
    main()
