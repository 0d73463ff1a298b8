"""One fit with ``start_method="spawn"`` (Lightning's ``ddp_spawn`` launcher), run as a plain script.

``python spawn_launch.py <hier_sliced|hier_pipeline|hier_bsp> <out.json>``: the main process builds the
module, Lightning spawns two CPU workers that train it, and hands rank 0's results back to the main
process. What the main process holds afterwards (the module's weights, the callback metrics, the best
checkpoint's path) goes to ``out.json`` and ``out.pt``, for tests/test_spawn_launch.py to compare with
one process training the same batches.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_hier import HierBSPStrategy, HierPipelineStrategy, HierSlicedStrategy

SAMPLES = 64
GLOBAL_BATCH = 16
EPOCHS = 2


class SpawnNet(pl.LightningModule):
    """Two layers, plain SGD: a global batch gives the same step whichever processes split it."""

    def __init__(self, batch_size: int = GLOBAL_BATCH, distributed_order: bool = False) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.distributed_order = distributed_order
        self.l1 = nn.Linear(8, 16)
        self.act = nn.Tanh()
        self.l2 = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.act(self.l1(x)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(SAMPLES, 8, generator=generator)
        y = (x[:, 0] + x[:, 1] > 0).long()
        dataset = TensorDataset(x, y)
        if self.distributed_order:
            # one process reading each epoch's global batches in the order Lightning's DistributedSampler
            # (shuffled, seed 0) spreads them over the ranks: the reference for data-parallel strategies
            sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
            return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler)
        return DataLoader(dataset, batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        x, y = self.train_dataloader().dataset.tensors
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size)


def make_strategy(name: str) -> pl.strategies.Strategy:
    if name == "hier_sliced":
        return HierSlicedStrategy(start_method="spawn", devices_per_node=2)
    if name == "hier_pipeline":
        return HierPipelineStrategy(start_method="spawn")
    if name == "hier_bsp":
        return HierBSPStrategy(start_method="spawn", superstep=1, max_staleness=0)
    raise ValueError(name)


def main() -> None:
    name, out = sys.argv[1], Path(sys.argv[2])
    torch.manual_seed(0)
    # the two data-parallel strategies split each global batch over the two processes; a pipeline is
    # one replica and reads it whole
    model = SpawnNet(GLOBAL_BATCH if name == "hier_pipeline" else GLOBAL_BATCH // 2)
    checkpoints = ModelCheckpoint(dirpath=tempfile.mkdtemp(), monitor="val_loss", save_top_k=1)
    trainer = pl.Trainer(
        strategy=make_strategy(name),
        accelerator="cpu",
        devices=2,
        max_epochs=EPOCHS,
        logger=False,
        callbacks=[checkpoints],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model)
    torch.save(model.state_dict(), out.with_suffix(".pt"))
    # the main process's module was never attached to the Trainer (only the workers ran the fit); Lightning's
    # own tests restore the best checkpoint into it through the strategy all the same
    best = torch.load(checkpoints.best_model_path, weights_only=False)
    trainer._checkpoint_connector.restore(checkpoints.best_model_path)
    restored = {k: torch.equal(v, best["state_dict"][k]) for k, v in model.state_dict().items()}
    result = {
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "best_model_path": checkpoints.best_model_path,
        "restored_equals_best": restored,
        "validate": trainer.validate(model, verbose=False),
    }
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
