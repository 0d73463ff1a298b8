"""Run under torchrun (2 processes): callbacks restored from a checkpoint see their state in ``on_fit_start``,
as under ``ddp``, and ``fit(weights_only=False)`` reaches the checkpoint's loading.

``restore_order_checks.py OUT_DIR`` runs, for Lightning's ``ddp`` (the reference) and each strategy; rank 0
writes ``OUT_DIR/results.json``:

- ``timer``: a fit stopped by a 0.3 s ``Timer``, checkpointed at its last step, then resumed with a fresh
  ``Timer`` whose restored budget is already spent. The resumed fit must take no step. A callback whose
  state holds a custom object is checkpointed too; it loads only if ``weights_only=False`` reaches
  ``torch.load``.
- ``swa``: ``StochasticWeightAveraging`` from epoch 2 with the user's ``LambdaLR``, checkpointed after
  epoch 3, then resumed to epoch 5. The checkpoint holds SWALR's state, which SWA must take back in
  ``on_fit_start`` before Lightning restores the schedulers. The final parameters are compared across
  strategies (``hier_pipeline`` refuses SWA, as a stage holds only part of the model).
- ``ema``: ``EMAWeightAveraging`` over two epochs, resumed to four. The callback loads the trained
  weights into the module after the strategy loaded the averaged ones; the final parameters are compared
  across strategies (not ``hier_pipeline``, which refuses weight averaging).
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint, StochasticWeightAveraging, Timer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import HierBSPStrategy, HierPipelineStrategy, HierSlicedStrategy

sys.path.insert(0, str(Path(__file__).parent))
from models import reported  # noqa: E402

STRATEGIES = {
    "reference": lambda: "ddp",
    "hier_sliced": lambda: HierSlicedStrategy(devices_per_node=2),
    "hier_bsp": lambda: HierBSPStrategy(superstep=1, max_staleness=0, devices_per_node=2),
    "hier_pipeline": lambda: HierPipelineStrategy(micro_batches=2, rebalance="never"),
}


class Note:
    """A custom object in a callback's state: ``torch.load(weights_only=True)`` refuses it."""

    def __init__(self, text: str) -> None:
        self.text = text


class KeepsANote(pl.Callback):
    def __init__(self) -> None:
        self.loaded: str | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"note": Note("kept")}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = state_dict["note"].text


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=generator)
    return DataLoader(TensorDataset(x, x[:, :2] * 2), batch_size=4)


def trainer(strategy: Any, root: Path, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, default_root_dir=root, logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, **kwargs,
    )  # fmt: skip


def timer(make_strategy: Any, root: Path) -> dict[str, Any]:
    saved = ModelCheckpoint(dirpath=root / "timer", save_top_k=-1)
    first = trainer(
        make_strategy(), root, max_epochs=1000, callbacks=[Timer(timedelta(seconds=0.3)), saved, KeepsANote()]
    )
    first.fit(Net(), loader())
    note = KeepsANote()
    resumed = trainer(make_strategy(), root, max_epochs=1000, callbacks=[Timer(timedelta(seconds=0.3)), note])
    resumed.fit(Net(), loader(), ckpt_path=saved.last_model_path or saved.best_model_path, weights_only=False)
    return {"saved_step": first.global_step, "resumed_step": resumed.global_step, "note": note.loaded}


def swa(make_strategy: Any, root: Path) -> list[float]:
    def fit(epochs: int, ckpt_path: str | None = None) -> pl.LightningModule:
        pl.seed_everything(3, verbose=False)
        model = Net()
        run = trainer(
            make_strategy(), root, max_epochs=epochs, limit_train_batches=5,
            callbacks=[StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2), saved],
        )  # fmt: skip
        run.fit(model, loader(), ckpt_path=ckpt_path, weights_only=False)
        return model

    saved = ModelCheckpoint(dirpath=root / "swa", save_last=True)
    fit(4)
    model = fit(5, saved.last_model_path)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def ema(make_strategy: Any, root: Path) -> list[float]:
    """Two epochs, a checkpoint, resumed to four: the checkpoint's ``state_dict`` holds the averaged weights
    and ``current_model_state`` the trained ones, which EMAWeightAveraging loads into the module itself."""

    def fit(epochs: int, ckpt_path: str | None = None) -> pl.LightningModule:
        pl.seed_everything(5, verbose=False)
        model = Net()
        run = trainer(
            make_strategy(), root, max_epochs=epochs, limit_train_batches=4,
            callbacks=[EMAWeightAveraging(decay=0.5), saved],
        )  # fmt: skip
        run.fit(model, loader(), ckpt_path=ckpt_path)
        return model

    saved = ModelCheckpoint(dirpath=root / "ema", save_last=True)
    fit(2)
    model = fit(4, saved.last_model_path)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


class RestoresItsRate(Net):
    """Keeps its learning rate in the checkpoint and builds its optimizer from it, recording the hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.rate, self.hooks = 0.1, []

    def setup(self, stage: str) -> None:
        self.hooks.append("setup")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rate"] = 0.02

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.hooks.append("on_load_checkpoint")
        self.rate = checkpoint["rate"]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.hooks.append("configure_optimizers")
        self.configured_rate = self.rate
        return torch.optim.SGD(self.parameters(), momentum=0.9, lr=self.rate)

    def on_fit_start(self) -> None:
        self.hooks.append("on_fit_start")


def hook_order(make_strategy: Any, root: Path) -> dict[str, Any]:
    """A resumed fit of a module whose ``configure_optimizers`` reads what ``on_load_checkpoint`` restored:
    the hooks' order, the rate ``configure_optimizers`` saw and the parameters after the resumed epoch
    (the optimizer state restored after setup brings the saved rate back, under every strategy)."""
    saved = ModelCheckpoint(dirpath=root / "hooks", save_last=True)
    pl.seed_everything(7, verbose=False)
    trainer(make_strategy(), root, max_epochs=1, limit_train_batches=4, callbacks=[saved]).fit(
        RestoresItsRate(), loader()
    )
    pl.seed_everything(7, verbose=False)
    model = RestoresItsRate()
    resumed = trainer(make_strategy(), root, max_epochs=2, limit_train_batches=4)
    resumed.fit(model, loader(), ckpt_path=saved.last_model_path)
    return {
        "hooks": model.hooks,
        "rate": model.configured_rate,
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist(),
    }


def main() -> None:
    out = Path(sys.argv[1])
    results = {}
    for name, make in STRATEGIES.items():
        # hier_pipeline refuses StochasticWeightAveraging (a stage holds part of the model)
        whole = name != "hier_pipeline"
        results[name] = {
            "timer": reported(timer, make, out / name),
            "swa": reported(swa, make, out / name) if whole else None,
            "ema": reported(ema, make, out / name) if whole else None,
            "hook_order": reported(hook_order, make, out / name),
        }
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
