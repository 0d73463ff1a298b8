"""Run under torchrun (4 processes as 2 nodes x 2): the digits example for 200 steps under
``hier_sliced`` in full precision and with ``inter_node_dtype="bf16"``; rank 0 writes each run's
loss over the whole training set to argv[1]."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn

from lightning_hier import HierSlicedStrategy
from lightning_hier.examples.digits import DigitsClassifier, DigitsDataModule

STEPS = 200


def train_loss(inter_node_dtype: str | None) -> float:
    pl.seed_everything(0, verbose=False)
    data = DigitsDataModule(batch_size=32)
    model = DigitsClassifier(hidden=128, lr=0.05, momentum=0.9)
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, max_steps=STEPS, num_sanity_val_steps=0, limit_val_batches=0,
        strategy=HierSlicedStrategy(devices_per_node=2, inter_node_dtype=inter_node_dtype),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, data)
    x, y = zip(*data.train_set)
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(torch.stack(x)), torch.tensor(y)))


def main() -> None:
    results = {"fp32": train_loss(None), "bf16": train_loss("bf16")}
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
