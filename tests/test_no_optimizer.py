"""A LightningModule whose ``configure_optimizers`` returns ``None`` fits as under Lightning's own strategies:
Lightning steps a no-op optimizer, the parameters stay as they were, and checkpoints save and resume
(``optimizer_states`` as Lightning writes them). Before 2026-11-27 ``hier_sliced`` and ``hier_bsp`` refused
the no-op optimizer as unknown and ``hier_pipeline`` failed to checkpoint (Lightning's ``test_none_optimizer``
forced onto them found it). One process per strategy, in this process; ``ddp`` is the reference."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_hier import HierBSPStrategy, HierPipelineStrategy, HierSlicedStrategy

STRATEGIES = {
    "ddp": lambda: "ddp",
    "hier_sliced": HierSlicedStrategy,
    "hier_bsp": lambda: HierBSPStrategy(superstep_steps=1, max_staleness=0),
    "hier_pipeline": HierPipelineStrategy,
}


class NoOptimizer(BoringModel):
    def configure_optimizers(self) -> None:
        return None


def _fit(strategy: str, root: Path, ckpt_path: str | None = None, max_epochs: int = 1) -> dict:
    torch.manual_seed(0)
    model = NoOptimizer()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=STRATEGIES[strategy](), max_epochs=max_epochs,
        limit_train_batches=3, limit_val_batches=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root,
        callbacks=[ModelCheckpoint(dirpath=root, save_last=True)],
    )  # fmt: skip
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, ckpt_path=ckpt_path)
    finally:
        if dist.is_initialized():  # the tests after this one check that no group exists yet
            dist.destroy_process_group()
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, initial[k])]
    return {"changed": changed, "step": trainer.global_step}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_fit_without_an_optimizer_leaves_the_model_and_checkpoints_as_lightning_does(
    tmp_path: Path, strategy: str
) -> None:
    result = _fit(strategy, tmp_path)
    assert result == {"changed": [], "step": 3}  # ddp's: three (no-op) optimizer steps, nothing updated
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert saved["optimizer_states"] == [{}]  # Lightning's no-op optimizer's state
    assert set(saved["state_dict"]) == set(NoOptimizer().state_dict())
    resumed = _fit(strategy, tmp_path / "resumed", ckpt_path=str(tmp_path / "last.ckpt"), max_epochs=2)
    assert resumed == {"changed": [], "step": 6}
