"""Run under torchrun (2 processes): Lightning-contract cases where ``hier_sliced`` must end where ``ddp``
ends, each fit run in every process as a user's script (or Lightning's ``popen`` start) runs it.

``lightning_contract_checks.py OUT_DIR``; rank 0 writes ``OUT_DIR/results.json``: per strategy (``ddp``
first) and per scenario the numbers to compare, or the error the scenario raised.

Scenarios:

- ``optimizer_built_outside``: an ``Adam`` and its ``ReduceLROnPlateau`` built before the fit from
  ``model.parameters()``, handed over by a ``configure_optimizers`` lambda (Lightning's
  ``test_lr_scheduler_strict``). The first fit monitors a metric nobody logs with ``strict=True`` and
  raises at its first epoch's end; a second fit on a new Trainer, with the same optimizer object,
  monitors the logged training loss. Recorded: the first fit's error, the parameters, the optimizer's
  state and learning rate after the second, and whether the optimizer holds the module's parameters.
- ``progress_bar_without_length``: ``max_steps=7`` on an endless generator of batches (no ``__len__``)
  with a ``TQDMProgressBar`` (and a ``RichProgressBar`` where ``rich`` is installed), as Lightning's
  ``test_tqdm_total_steps_with_iterator_no_length`` and ``test_progress_bar_steps``: per rank, whether
  the bar is enabled and the total of its training bar (``None`` where it made none).
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import HierSlicedStrategy

sys.path.insert(0, str(Path(__file__).parent))
from models import reported  # noqa: E402

STRATEGIES = {"ddp": lambda: "ddp", "hier_sliced": lambda: HierSlicedStrategy(devices_per_node=2)}


class Net(pl.LightningModule):
    """Linear-tanh-linear regression that logs its epoch's mean training loss (over both ranks)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, torch.sin(x[:, :2]) * 2), batch_size=4)


def trainer(strategy: Any, root: Path, **kwargs: Any) -> pl.Trainer:
    options = dict(
        accelerator="cpu", devices=2, strategy=strategy, default_root_dir=root, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    return pl.Trainer(**{**options, **kwargs})


def flat(tensors: list[torch.Tensor]) -> list[float]:
    return torch.cat([t.detach().reshape(-1) for t in tensors]).tolist()


def optimizer_built_outside(make: Callable[[], Any], root: Path) -> dict[str, Any]:
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5, threshold=0.5)

    def monitoring(metric: str) -> Any:
        return lambda: {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "monitor": metric, "strict": True},
        }

    model.configure_optimizers = monitoring("giraffe")
    first_error = "none"
    try:
        trainer(make(), root / "first", max_epochs=1).fit(model)
    except Exception as error:  # noqa: BLE001 - what the first fit raised is the result
        first_error = f"{type(error).__name__}: {error}"[:200]
    model.configure_optimizers = monitoring("train_loss")
    trainer(make(), root / "second", max_epochs=3).fit(model)
    params = list(model.parameters())
    held = [p for group in optimizer.param_groups for p in group["params"]]
    return {
        "first_error": first_error,
        "params": flat(params),
        "exp_avg_sq": flat([optimizer.state[p]["exp_avg_sq"] for p in params]),
        "steps": [float(optimizer.state[p]["step"]) for p in params],
        "lr": optimizer.param_groups[0]["lr"],
        "holds_module_parameters": len(held) == len(params) and all(a is b for a, b in zip(held, params)),
    }


def train_bar_total(bar: TQDMProgressBar | RichProgressBar) -> float | None:
    """The total of ``bar``'s training bar, ``None`` where it made none (a disabled bar)."""
    if isinstance(bar, RichProgressBar):
        return None if bar.progress is None else bar.train_progress_bar.total
    return None if bar._train_progress_bar is None else bar.train_progress_bar.total


def progress_bar_without_length(make: Callable[[], Any], root: Path) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for bar in [TQDMProgressBar(), *([RichProgressBar()] if _RICH_AVAILABLE else [])]:
        model = Net()
        generator = torch.Generator().manual_seed(dist.get_rank())
        batches = (
            (torch.randn(4, 8, generator=generator), torch.randn(4, 2, generator=generator))
            for _ in itertools.count()
        )
        model.train_dataloader = lambda batches=batches: batches
        run = trainer(
            make(),
            root / type(bar).__name__,
            max_steps=7,
            max_epochs=-1,
            enable_progress_bar=True,
            callbacks=[bar],
        )
        run.fit(model)
        mine = {"enabled": bar.is_enabled, "train_bar_total": train_bar_total(bar)}
        every_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, mine)
        found[type(bar).__name__] = every_rank
    return found


SCENARIOS = {
    "optimizer_built_outside": optimizer_built_outside,
    "progress_bar_without_length": progress_bar_without_length,
}


def main() -> None:
    out = Path(sys.argv[1])
    results: dict[str, dict[str, Any]] = {}
    for name, make in STRATEGIES.items():
        results[name] = {
            scenario: reported(run, make, out / name / scenario) for scenario, run in SCENARIOS.items()
        }
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
