"""Run under torchrun (2 processes): what ``Trainer(sync_batchnorm=True)`` makes of the model's BatchNorm
under ``hier_sliced`` and ``hier_pipeline`` (the layer types when training starts, and after fit); rank 0
writes ``{strategy: {"training": ..., "after": ..., "warned": ...}}`` to OUT. (Lightning's ``ddp``
cannot be run beside them on CPU: DDP refuses SyncBatchNorm on CPU modules when it wraps the model.)"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

from models import loader  # noqa: E402

from lightning_hier import HierPipelineStrategy, HierSlicedStrategy  # noqa: E402


class NormNet(pl.LightningModule):
    """Linear, BatchNorm, ReLU, Linear (traceable, so the pipeline can split it)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.1)


class NormType(pl.Callback):
    """Records the BatchNorm layer's type once setup is done, then stops before the first batch (torch's
    SyncBatchNorm only runs on accelerators)."""

    def __init__(self) -> None:
        self.training: str | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: NormNet) -> None:
        self.training = type(pl_module.norm).__name__
        trainer.should_stop = True


def main() -> None:
    out = Path(sys.argv[1])
    strategies = {
        "hier_sliced": lambda: HierSlicedStrategy(devices_per_node=1),
        "hier_pipeline": lambda: HierPipelineStrategy(rebalance="never"),
    }
    results = {}
    for name, make in strategies.items():
        model, seen = NormNet(), NormType()
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy=make(), sync_batchnorm=True, max_epochs=1,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[seen],
        )  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, train_dataloaders=loader())
        results[name] = {
            "training": seen.training,
            "after": type(model.norm).__name__,
            "warned": any("sync_batchnorm=True" in str(w.message) for w in caught),
        }
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
