"""The installed Lightning is checked against the tested range at import, and every Lightning internal the
package uses (``lightning_hier/strategies/lightning_patches.py``) exists in the installed Lightning.

CI runs this file with the oldest and the newest Lightning of the range (``.ci/run``).
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from lightning_hier.strategies.lightning_patches import (
    ALLOW_UNTESTED_ENV,
    TESTED_LIGHTNING,
    check_lightning_version,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version", ["2.6.0", "2.6.6", "2.6.7.post1"])
def test_a_release_in_the_tested_range_imports_quietly(version: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_lightning_version(version)


@pytest.mark.parametrize("version", ["2.4.0", "2.5.6", "2.6.0rc1", "2.7.0rc1", "2.7.0", "3.0.0"])
def test_a_release_outside_the_range_is_refused_with_how_to_install_one(
    version: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(ImportError) as raised:
        check_lightning_version(version)
    message = str(raised.value)
    assert f"lightning {version} is installed" in message
    assert "supports Lightning >=2.6.0,<2.7" in message
    assert "pip install 'lightning>=2.6.0,<2.7'" in message
    assert f"{ALLOW_UNTESTED_ENV}=1" in message


def test_the_override_turns_the_refusal_into_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    with pytest.warns(UserWarning, match=r"lightning 2\.7\.0 is installed.*going on untested"):
        check_lightning_version("2.7.0")
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "0")  # only "1" overrides
    with pytest.raises(ImportError):
        check_lightning_version("2.7.0")


def _import_under(version: str, allow: bool) -> subprocess.CompletedProcess:
    """``import lightning_hier`` in a fresh interpreter whose Lightning reports ``version``."""
    env = {k: v for k, v in os.environ.items() if k != ALLOW_UNTESTED_ENV}
    if allow:
        env[ALLOW_UNTESTED_ENV] = "1"
    code = f"import lightning; lightning.__version__ = {version!r}; import lightning_hier; print('imported')"
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_importing_the_package_checks_the_installed_lightning() -> None:
    refused = _import_under("2.5.3", allow=False)
    assert refused.returncode != 0
    assert "ImportError: lightning_hier supports Lightning >=2.6.0,<2.7" in refused.stderr
    assert "lightning 2.5.3 is installed" in refused.stderr
    allowed = _import_under("2.5.3", allow=True)
    assert allowed.returncode == 0, allowed.stderr
    assert allowed.stdout.strip() == "imported"
    assert "going on untested" in allowed.stderr


def test_pyproject_requires_the_tested_range() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lightning = [spec for spec in project["dependencies"] if spec.replace(" ", "").startswith("lightning>")]
    assert lightning == [f"lightning{TESTED_LIGHTNING}"]


def test_every_lightning_internal_used_exists_in_the_installed_lightning() -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.fabric.plugins.io import torch_io
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.loops.fit_loop import _FitLoop
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    results = _ResultCollection(training=True)
    results.log("training_step", "loss", torch.tensor(1.0), on_step=True, on_epoch=True)
    used = {
        _TrainingEpochLoop: [
            "_broadcast_sigterm_tensor",
            "_should_check_val_fx",
            "_should_check_val_epoch",
            "_should_accumulate",
        ],
        _FitLoop: ["setup_data", "on_advance_end", "_can_stop_early"],
        Precision: [
            "_after_closure",
            "_wrap_closure",
            "post_backward",
            "clip_grad_by_norm",
            "clip_gradients",
        ],
        DDPStrategy: ["_get_process_group_backend"],
        _CheckpointConnector: ["_restore_modules_and_callbacks"],
        _ResultCollection: ["update_metrics"],
        pl.Trainer: ["_run", "_results"],
        trainer: ["_accelerator_connector", "_checkpoint_connector"],
        trainer.fit_loop: ["_combined_loader", "_data_source"],
        trainer.validate_loop: ["_data_source"],
        trainer.test_loop: ["_data_source"],
        trainer.predict_loop: ["_predictions", "epoch_batch_indices", "_data_source"],
        BoringModel(): ["_trainer", "_current_fx_name", "_compiler_ctx", "_param_requires_grad_state",
                        "_on_before_batch_transfer", "_apply_batch_transfer_handler"],  # fmt: skip
        DDPStrategy(): ["_timeout", "_layer_sync", "_process_group_backend", "_lightning_optimizers"],
        ModelCheckpoint(): ["_every_n_train_steps", "_train_time_interval"],
        results["training_step.loss"]: ["_forward_cache", "is_tensor", "value", "meta"],
        torch_io: ["_atomic_save"],  # a module global that TorchCheckpointIO.save_checkpoint reads
    }
    missing = [
        f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"
        for owner, names in used.items()
        for name in names
        if not hasattr(owner, name)
    ]
    assert missing == []
    # read from the frame of Trainer._run and passed to the connector by these names
    assert list(inspect.signature(pl.Trainer._run).parameters)[2:] == ["ckpt_path", "weights_only"]
    restore = inspect.signature(_CheckpointConnector._restore_modules_and_callbacks)
    assert list(restore.parameters) == ["self", "checkpoint_path", "weights_only"]
