"""Run under torchrun (1 process) with ``LIGHTNING_HIER_DEVICE_BACKEND=emulated_nccl`` and
``LIGHTNING_HIER_AUDIT_DIR`` set by tests/test_import_side_effects.py.

``setup_from_env.py STRATEGY OUT`` imports the package, fits two steps under ``STRATEGY`` (a registered
name) and writes to OUT what had started after the import and what had at the fit's start, once the
strategy's ``setup_distributed`` ran: the emulated backend, the default group's backends, the audit's
wrappers around ``torch.distributed`` and the exit handler.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

TORCH_ALL_REDUCE = dist.all_reduce  # torch's own, before the package is imported

import lightning_hier  # noqa: E402, F401  (registers the strategy names)
from lightning_hier.audit import EMULATED_NCCL  # noqa: E402
from lightning_hier.strategies import process_group_exit  # noqa: E402


def started() -> dict:
    return {
        "emulated_backend": EMULATED_NCCL in dist.Backend.backend_list,
        "default_group": dist.get_backend_config() if dist.is_initialized() else None,
        "audit": dist.all_reduce is not TORCH_ALL_REDUCE,
        "exit_handler": process_group_exit._registered,
    }


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.at_fit_start: dict | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_fit_start(self) -> None:
        self.at_fit_start = started()


def main() -> None:
    strategy, out = sys.argv[1], Path(sys.argv[2])
    after_import = started()
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
    model = Net()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=data)
    out.write_text(json.dumps({"after_import": after_import, "at_fit_start": model.at_fit_start}))


if __name__ == "__main__":
    main()
