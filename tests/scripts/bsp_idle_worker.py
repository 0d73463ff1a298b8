"""Run under torchrun (2 processes): ``hier_bsp`` (``superstep=1, max_staleness=1``) where rank 1's loader
yields only ``None`` batches, which Lightning skips without a step, so rank 1 takes no micro-step in any
epoch while rank 0 trains. Rank 0 writes to argv[1] the epochs run, each rank's steps and whether the
ranks' parameters agree at the end and moved from the start. A worker whose module never ticked again after
a drain left the others' collectives waiting: the groups' timeout is short here so that shows as a failure.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader, default_collate

from lightning_hier import HierBSPStrategy

EPOCHS = 3


def collate(samples: list) -> object:
    return None if os.environ["RANK"] == "1" else default_collate(samples)


class Model(BoringModel):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 16), batch_size=2, collate_fn=collate)


def main() -> None:
    pl.seed_everything(0, verbose=False)
    model = Model()
    initial = [p.detach().clone() for p in model.parameters()]
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_epochs=EPOCHS, limit_val_batches=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        strategy=HierBSPStrategy(superstep=1, max_staleness=1, timeout=timedelta(seconds=60)),
    )  # fmt: skip
    trainer.fit(model)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(params) for _ in range(2)]
    dist.all_gather(every, params)
    steps: list = [None, None]
    dist.all_gather_object(steps, trainer.global_step)
    if dist.get_rank() == 0:
        moved = float((params - torch.cat([p.reshape(-1) for p in initial])).abs().max())
        result = {
            "epochs": trainer.current_epoch,
            "steps": steps,
            "agree": bool(torch.equal(every[0], every[1])),
            "moved": moved,
        }
        Path(sys.argv[1]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
