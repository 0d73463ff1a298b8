"""A LightningModule whose ``configure_optimizers`` returns ``None`` fits as under Lightning's own strategies:
Lightning steps a no-op optimizer, the parameters stay as they were, and checkpoints save and resume
(``optimizer_states`` as Lightning writes them). A regression would show as ``hier_sliced`` or ``hier_bsp``
refusing the no-op optimizer as unknown, or ``hier_pipeline`` failing to checkpoint (as Lightning's
``test_none_optimizer`` forced onto them checks too). One process per strategy, in this process; ``ddp``
is the reference."""

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
    "hier_bsp": lambda: HierBSPStrategy(superstep=1, max_staleness=0),
    "hier_pipeline": HierPipelineStrategy,
}


class NoOptimizer(BoringModel):
    def configure_optimizers(self) -> None:
        return None


def _fit_in_this_process(trainer: pl.Trainer, model: pl.LightningModule, **fit_kwargs: object) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, **fit_kwargs)
    finally:
        if dist.is_initialized():  # the tests after this one check that no group exists yet
            dist.destroy_process_group()


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
    _fit_in_this_process(trainer, model, ckpt_path=ckpt_path)
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


class SharedOptimizer(BoringModel):
    """``configure_optimizers`` returns the same Adam object on every fit (as Lightning's own tests do)."""

    def __init__(self) -> None:
        super().__init__()
        self.optimizer = torch.optim.Adam(self.parameters(), lr=0.01)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer

    def train_dataloader(self) -> torch.utils.data.DataLoader:  # the same batches whatever RNG setup consumed
        data = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(data, batch_size=2)


def _two_fits_one_optimizer(strategy: str | None, root: Path) -> tuple[dict, dict]:
    torch.manual_seed(0)
    model = SharedOptimizer()
    for fit in range(2):
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, strategy=STRATEGIES[strategy]() if strategy else "auto",
            max_steps=3, limit_val_batches=0, logger=False, use_distributed_sampler=False,
            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
            default_root_dir=root / str(fit),
        )  # fmt: skip
        _fit_in_this_process(trainer, model)
    return model.state_dict(), model.optimizer.state_dict()


@pytest.mark.parametrize("strategy", ["hier_sliced", "hier_bsp"])
def test_an_optimizer_object_fits_twice_as_on_one_device(tmp_path: Path, strategy: str) -> None:
    """After a fit the optimizer is given back with the module's parameters and its full state, as one
    device leaves it; a second fit (another Trainer) goes on from that state. A regression would show as
    hier_sliced's object keeping the first run's flat slices, so that the second fit refuses it ("no
    trainable parameters"), or as hier_bsp's keeping no state at all (its server steps a copy), so that the
    second fit begins Adam afresh."""
    reference_params, reference_state = _two_fits_one_optimizer(None, tmp_path / "reference")
    params, state = _two_fits_one_optimizer(strategy, tmp_path / strategy)
    for name, value in reference_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-7)
    assert state["param_groups"] == reference_state["param_groups"]
    for index, entry in reference_state["state"].items():
        assert float(entry["step"]) == 6.0
        for key, value in entry.items():
            torch.testing.assert_close(state["state"][index][key], value, rtol=1e-5, atol=1e-7)


def _resume_without_optimizer_states(strategy: str | None, ckpt: Path, root: Path) -> dict:
    model = SharedOptimizer()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=STRATEGIES[strategy]() if strategy else "auto",
        max_steps=5, limit_val_batches=0, logger=False, use_distributed_sampler=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=root,
    )  # fmt: skip
    _fit_in_this_process(trainer, model, ckpt_path=ckpt)
    return model.state_dict()


def test_a_checkpoint_with_no_optimizer_states_resumes_as_on_one_device(tmp_path: Path) -> None:
    """Lightning loads nothing from an empty ``optimizer_states`` (NeMo writes such files); neither do
    hier_sliced and hier_bsp (a regression would show as "0 optimizer state(s); this run has 1")."""
    torch.manual_seed(0)
    ckpt = tmp_path / "weights.ckpt"
    torch.save({"state_dict": SharedOptimizer().state_dict(), "optimizer_states": [], "lr_schedulers": [],
                "global_step": 2, "epoch": 0, "pytorch-lightning_version": pl.__version__}, ckpt)  # fmt: skip
    reference = _resume_without_optimizer_states(None, ckpt, tmp_path / "reference")
    for strategy in ("hier_sliced", "hier_bsp", "hier_pipeline"):
        resumed = _resume_without_optimizer_states(strategy, ckpt, tmp_path / strategy)
        for name, value in reference.items():
            torch.testing.assert_close(resumed[name], value, rtol=1e-5, atol=1e-7, msg=f"{strategy} {name}")


def test_a_refit_after_a_raising_fit_goes_on_from_the_optimizer_state_as_ddp(tmp_path: Path) -> None:
    """Two processes on one node: the first fit raises on every rank and leaves the optimizer held by its
    engine (sharded, or whole with ``shard_optimizer=False``); the same Trainer's next fit gives it back
    before taking it again and goes on from its state, as under ddp (tests/scripts/refit_checks.py); the
    second fit must not refuse it."""
    import json

    from helpers import run_torchrun

    out = tmp_path / "refit.json"
    run_torchrun("refit_checks.py", 2, str(out), timeout=300)
    results = json.loads(out.read_text())
    reference = results["reference"]
    assert reference["error"] == "planned" and reference["steps"][0] > 2
    for name in ("hier_sliced", "hier_sliced_whole"):  # the optimizer sharded, and kept whole on every rank
        hier = results[name]
        assert hier["error"] == "planned", name
        assert hier["steps"] == reference["steps"], name
        for got, want in zip(
            hier["params"] + hier["exp_avg"], reference["params"] + reference["exp_avg"], strict=True
        ):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6), name
