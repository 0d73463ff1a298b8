"""Callbacks a strategy cannot serve (Lightning's fine-tuning callbacks under ``hier_pipeline``), and
parameters the optimizer gains where an engine cannot take them in (``add_param_group`` or unfreezing in
the middle of a step), are refused with an error naming them, instead of failing inside the callback or
silently never being updated. tests/test_finetuning.py: what ``hier_sliced`` and ``hier_bsp`` take in."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import free_port, run_torchrun
from lightning.pytorch.callbacks import BackboneFinetuning, StochasticWeightAveraging
from scripts.models import EquivModel, loader
from torch import nn

from lightning_hier import HierBSPStrategy, HierPipelineStrategy, Topology
from lightning_hier.bsp.engine import BSPEngine
from lightning_hier.bsp.settings import BSPSettings


class WithBackbone(EquivModel):
    """``BackboneFinetuning`` freezes ``self.backbone`` at fit start and unfreezes it at epoch 1."""

    def __init__(self) -> None:
        super().__init__(optimizer="adam")
        self.backbone = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, extra: bool = False) -> torch.Tensor:
        return super().forward(self.backbone(x), extra)


def test_fine_tuning_callbacks_are_refused_by_the_pipeline_before_any_process_group(tmp_path: Path) -> None:
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=HierPipelineStrategy(), max_epochs=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path,
        callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)],
    )  # fmt: skip
    with pytest.raises(ValueError, match="BackboneFinetuning unfreezes parameters during fit"):
        trainer.fit(WithBackbone(), train_dataloaders=loader())
    assert not dist.is_initialized()


@pytest.mark.parametrize("averaging", ["StochasticWeightAveraging", "EMAWeightAveraging", "ModelPruning"])
def test_whole_model_callbacks_are_refused_by_the_pipeline_before_any_process_group(
    tmp_path: Path, averaging: str
) -> None:
    """Each pipeline process holds only its stage's parameters; these callbacks average a full copy or mask
    every parameter (let through, EMAWeightAveraging would fail at its first update, ModelPruning at the
    first checkpoint, with size mismatches)."""
    from lightning.pytorch.callbacks import EMAWeightAveraging, ModelPruning

    callback = {
        "StochasticWeightAveraging": lambda: StochasticWeightAveraging(swa_lrs=1e-2),
        "EMAWeightAveraging": EMAWeightAveraging,
        "ModelPruning": lambda: ModelPruning("l1_unstructured", amount=0.3),
    }[averaging]()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=HierPipelineStrategy(), max_epochs=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path,
        callbacks=[callback],
    )  # fmt: skip
    with pytest.raises(ValueError, match=f"{averaging} (averages a full copy|masks parameters)"):
        trainer.fit(EquivModel(), train_dataloaders=loader())
    assert not dist.is_initialized()


def test_a_module_without_forward_is_refused_by_the_pipeline_before_any_process_group(tmp_path: Path) -> None:
    """A pipeline splits ``forward``; a module whose steps call submodules directly has none (let through,
    it would fail with an fx error about iterating a Proxy)."""

    class NoForward(EquivModel):
        forward = pl.LightningModule.forward

    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=HierPipelineStrategy(), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path,
    )  # fmt: skip
    with pytest.raises(ValueError, match="NoForward defines no forward"):
        trainer.fit(NoForward(), train_dataloaders=loader())
    assert not dist.is_initialized()


@pytest.mark.parametrize("max_staleness", [1, 0])
def test_per_step_weight_averaging_under_hier_bsp_warns_off_lockstep(
    tmp_path: Path, max_staleness: int
) -> None:
    """Off lockstep the average trails ddp's; in plain BSP it does not (tests/test_restore_order.py compares
    it with ddp), and a warning there would be wrong."""
    import warnings

    from lightning.pytorch.callbacks import EMAWeightAveraging

    trainer = pl.Trainer(
        accelerator="cpu", devices=1,
        strategy=HierBSPStrategy(superstep=1, max_staleness=max_staleness),
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        default_root_dir=tmp_path, callbacks=[EMAWeightAveraging()],
    )  # fmt: skip
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(EquivModel(), train_dataloaders=loader())
        trailing = [w for w in caught if "trails ddp's by about a step" in str(w.message)]
        assert len(trailing) == (1 if max_staleness else 0), [str(w.message) for w in caught]
    finally:
        if dist.is_initialized():  # the tests after this one check that no group exists yet
            dist.destroy_process_group()


def test_sync_batchnorm_as_ddp_converts_it_or_said_why_not(tmp_path: Path) -> None:
    """hier_sliced converts BatchNorm to SyncBatchNorm for training and back afterwards, as ddp does
    (a regression would show as the flag silently ignored); a pipeline is one replica: nothing to sync, it
    says so and leaves the layer alone."""
    import json

    out = tmp_path / "sync_bn.json"
    run_torchrun("sync_batchnorm_check.py", 2, str(out), timeout=300)
    result = json.loads(out.read_text())
    # ddp's behaviour (its setup applies the layer sync for fit, its teardown reverts it); ddp itself
    # cannot run on CPU with SyncBatchNorm (DDP refuses it when wrapping a CPU module)
    # (Lightning's revert makes a _BatchNormXd, a BatchNorm that takes any input rank)
    assert result["hier_sliced"] == {"training": "SyncBatchNorm", "after": "_BatchNormXd", "warned": False}
    assert result["hier_pipeline"] == {"training": "BatchNorm1d", "after": "BatchNorm1d", "warned": True}


def test_hier_bsp_refuses_sync_batchnorm_before_any_process_group(tmp_path: Path) -> None:
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=HierBSPStrategy(), sync_batchnorm=True, max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path,
    )  # fmt: skip
    with pytest.raises(ValueError, match="sync_batchnorm=True with HierBSPStrategy"):
        trainer.fit(EquivModel(batch_norm=True), train_dataloaders=loader())
    assert not dist.is_initialized()


@pytest.fixture
def bsp_engine():  # noqa: ANN201
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model[0].requires_grad_(False)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    topology = Topology(1, 0, 1).build_groups(timedelta(seconds=30), dedicated=True)
    settings = BSPSettings(superstep=1, max_staleness=0)
    engine = BSPEngine(model, optimizer, topology, settings, timeout_s=30)
    yield model, optimizer, engine
    engine.abort()  # the step that raised never finished
    engine.close()
    dist.destroy_process_group()


def _micro_step(model: nn.Module, engine: BSPEngine) -> None:
    engine.begin_step()
    model(torch.randn(2, 4)).sum().backward()
    engine.end_step()


def test_hier_bsp_refuses_a_parameter_unfrozen_after_setup(bsp_engine) -> None:  # noqa: ANN001
    model, optimizer, engine = bsp_engine
    _micro_step(model, engine)  # the unchanged model steps
    optimizer.add_param_group({"params": [model[0].weight], "lr": 0.01})
    model[0].weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"'0.weight' was frozen at setup.*hier_bsp"):
        _micro_step(model, engine)


def test_hier_bsp_refuses_add_param_group_after_setup(bsp_engine) -> None:  # noqa: ANN001
    model, optimizer, engine = bsp_engine
    optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    with pytest.raises(RuntimeError, match="hier_bsp takes in a group from add_param_group between steps"):
        _micro_step(model, engine)
