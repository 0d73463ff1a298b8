"""``hier_bsp`` off lockstep with validation turned off (``limit_val_batches=0``): a ``val_check_interval``
that no validation reads is no reason to refuse the fit, and the fit runs as under ``ddp``."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest

from lightning_hier import HierBSPStrategy


def fit(strategy: Any, tmp_path: Path, val_check_interval: int | float) -> dict:
    """Fit the test MLP for one epoch (32 batches) with validation off; what a user sees afterwards."""
    import lightning.pytorch as pl
    import torch
    from scripts.models import EquivModel, loader

    class Validated(EquivModel):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", self.training_step(batch, batch_idx))

    class Counting(pl.Callback):
        validation_batches = 0

        def on_validation_batch_end(self, *args: Any, **kwargs: Any) -> None:
            Counting.validation_batches += 1

    torch.manual_seed(0)
    model = Validated()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, limit_val_batches=0,
        val_check_interval=val_check_interval, callbacks=[Counting()], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=loader(), val_dataloaders=loader())
    return {
        "status": trainer.state.status.value,
        "global_step": trainer.global_step,
        "validation_batches": Counting.validation_batches,
        "trained": any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters())),
    }


@pytest.mark.parametrize("val_check_interval", [40, 0.5])
def test_a_val_check_interval_with_validation_off_fits_as_under_ddp(
    tmp_path: Path, val_check_interval: int | float
) -> None:
    """An int interval longer than the epoch (Lightning allows it with validation off) and a fractional one,
    which Lightning sizes on the train loader: workers keep their fixed shares of the batches (a loader whose
    batches they share has no length), with a warning."""
    reference = fit("ddp", tmp_path / "ddp", val_check_interval)
    fractional = isinstance(val_check_interval, float)
    with pytest.warns(UserWarning, match="fixed shards") if fractional else contextlib.nullcontext():
        got = fit(HierBSPStrategy(max_staleness=1), tmp_path / "bsp", val_check_interval)
    assert reference == {"status": "finished", "global_step": 32, "validation_batches": 0, "trained": True}
    assert got == reference


def test_a_training_step_on_the_dataloader_iter_keeps_fixed_shards_as_under_ddp(tmp_path: Path) -> None:
    """A ``training_step(dataloader_iter)`` that fetches two batches per step: with shared batches a worker
    could claim an odd count, meet the end mid-step and return None, which Lightning refuses on several
    processes. The workers keep ``ddp``'s fixed shards (its sampler, its count of steps), with a warning."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
    from torch.utils.data import DataLoader

    class TwoPerStep(BoringModel):
        def training_step(self, dataloader_iter: Any) -> Any:
            batches = [next(dataloader_iter)[0] for _ in range(2)]
            self.samplers.add(type(self.trainer.train_dataloader.sampler).__name__)
            return sum(self.layer(batch).sum() for batch in batches)

    def run(strategy: Any, root: Path) -> dict:
        model = TwoPerStep()
        model.samplers = set()
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, limit_val_batches=0, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=root,
        )  # fmt: skip
        trainer.fit(model, train_dataloaders=DataLoader(RandomDataset(32, 16), batch_size=2))
        return {"global_step": trainer.global_step, "samplers": model.samplers}

    reference = run("ddp", tmp_path / "ddp")
    with pytest.warns(UserWarning, match="fixed shards.*dataloader_iter"):
        got = run(HierBSPStrategy(max_staleness=1), tmp_path / "bsp")
    assert reference == {"global_step": 4, "samplers": {"DistributedSampler"}}
    assert got == reference
