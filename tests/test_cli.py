"""``python -m lightning_hier fit --config x.yaml`` (LightningCLI) with hier_sliced on 2 CPU processes."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_CONFIG = ROOT / "examples" / "configs" / "hier_sliced.yaml"


def run_cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for var in ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return subprocess.run(
        [sys.executable, "-m", "lightning_hier", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def digits_config(root: Path, strategy: str | dict, epochs: int = 2) -> dict:
    trainer = {
        "accelerator": "cpu",
        "devices": 2,
        "strategy": strategy,
        "max_epochs": epochs,
        "log_every_n_steps": 5,
        "default_root_dir": str(root),
        "enable_progress_bar": False,
        "enable_checkpointing": False,
        "enable_model_summary": False,
    }
    if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
        # Lightning's default logger would be TensorBoard; ask for the CSV one explicitly
        trainer["logger"] = {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(root)},
        }
    return {
        "seed_everything": 0,
        "trainer": trainer,
        "model": {
            "class_path": "lightning_hier.examples.digits.DigitsClassifier",
            "init_args": {"hidden": 64},
        },
        "data": {
            "class_path": "lightning_hier.examples.digits.DigitsDataModule",
            "init_args": {"batch_size": 16},
        },
    }


def write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def val_accuracies(root: Path) -> list[float]:
    files = sorted(root.rglob("metrics.csv"))
    assert len(files) == 1, f"expected one metrics.csv under {root}, found {files}"
    with files[0].open() as handle:
        return [float(row["val_acc"]) for row in csv.DictReader(handle) if row.get("val_acc")]


def failure(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param("hier_sliced", id="string"),
        pytest.param(
            {
                "class_path": "lightning_hier.HierSlicedStrategy",
                "init_args": {"devices_per_node": 2, "slice_weights": [3, 1], "bucket_cap_mb": 0.01},
            },
            id="class_path",
        ),
    ],
)
def test_fit_digits_on_two_processes(tmp_path: Path, strategy: str | dict) -> None:
    config = write_config(tmp_path / "config.yaml", digits_config(tmp_path / "run", strategy))
    proc = run_cli("fit", "--config", str(config), cwd=tmp_path)
    assert proc.returncode == 0, failure(proc)
    assert "Starting with 2 processes" in proc.stdout + proc.stderr, failure(proc)
    accuracies = val_accuracies(tmp_path / "run")
    assert len(accuracies) == 2, accuracies  # one validation per epoch
    assert accuracies[-1] > 0.5, accuracies


def test_example_config_parses() -> None:
    proc = run_cli("fit", "--config", str(EXAMPLE_CONFIG), "--print_config", cwd=ROOT, timeout=120)
    assert proc.returncode == 0, failure(proc)
    printed = yaml.safe_load(proc.stdout)
    strategy = printed["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_hier.HierSlicedStrategy"
    assert strategy["init_args"]["devices_per_node"] == 2
    assert strategy["init_args"]["slice_weights"] == "equal"
    assert printed["model"]["class_path"] == "lightning_hier.examples.digits.DigitsClassifier"


def test_bad_slice_weights_exit_non_zero_naming_the_setting(tmp_path: Path) -> None:
    strategy = {
        "class_path": "lightning_hier.HierSlicedStrategy",
        "init_args": {"slice_weights": [1, 2, 3], "devices_per_node": 2},
    }
    config = write_config(tmp_path / "bad.yaml", digits_config(tmp_path / "run", strategy))
    proc = run_cli("fit", "--config", str(config), cwd=tmp_path, timeout=120)
    assert proc.returncode != 0, failure(proc)
    # an error line names the setting (not just the echo of the parsed values, "Namespace(...)")
    named = [
        line for line in proc.stderr.splitlines() if "slice_weights" in line and "Namespace(" not in line
    ]
    assert named, failure(proc)
    # refused while building the Trainer: no worker process was started, nothing trained
    assert "Initializing distributed" not in proc.stdout + proc.stderr
    assert not list(tmp_path.rglob("metrics.csv"))


def _cli_trainer(config: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The Trainer LightningCLI builds from ``config`` in this process (nothing is launched or fitted)."""
    from lightning.pytorch.cli import LightningCLI

    import lightning_hier  # noqa: F401  (registers the strategies, as ``python -m lightning_hier`` does)

    monkeypatch.setattr(sys, "argv", ["lightning_hier"])
    cli = LightningCLI(
        subclass_mode_model=True, subclass_mode_data=True, run=False, args=["--config", str(config)]
    )
    return cli.trainer


def test_time_buckets_are_built_from_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_hier import HierSlicedStrategy, TimeBuckets

    fields = {"profile_steps": 2, "warmup_steps": 0, "reprofile_check_every": 5, "min_bucket_mb": 0.5}
    strategy = {
        "class_path": "lightning_hier.HierSlicedStrategy",
        "init_args": {
            "devices_per_node": 2,
            "bucketing": {"class_path": "lightning_hier.TimeBuckets", "init_args": fields},
        },
    }
    config = write_config(tmp_path / "timed.yaml", digits_config(tmp_path / "run", strategy))
    trainer = _cli_trainer(config, monkeypatch)
    assert isinstance(trainer.strategy, HierSlicedStrategy)
    assert trainer.strategy.bucketing == "time"
    assert trainer.strategy.time_config == TimeBuckets(**fields)


def test_a_bad_time_buckets_field_in_yaml_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = {"class_path": "lightning_hier.TimeBuckets", "init_args": {"profile_steps": 0}}
    strategy = {"class_path": "lightning_hier.HierSlicedStrategy", "init_args": {"bucketing": bad}}
    config = write_config(tmp_path / "bad.yaml", digits_config(tmp_path / "run", strategy))
    message = "TimeBuckets(profile_steps=0): profile_steps must be an integer >= 1"
    with pytest.raises(ValueError, match=re.escape(message)):
        _cli_trainer(config, monkeypatch)


DLRM_CONFIG = ROOT / "examples" / "configs" / "dlrm_hybrid.yaml"


def _our_segments() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob(f"lightning_hier-{os.getuid()}-*")} if shm.is_dir() else set()


def test_dlrm_example_with_hybrid_embeddings_learns_and_leaves_no_segments(tmp_path: Path) -> None:
    before = _our_segments()
    config = yaml.safe_load(DLRM_CONFIG.read_text())
    config["trainer"].update(
        devices=2, max_epochs=2, default_root_dir=str(tmp_path / "run"), enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    config["trainer"]["strategy"]["init_args"]["devices_per_node"] = 2
    # Lightning's default logger is TensorBoard's where tensorboard is installed: the CSV is read below
    config["trainer"]["logger"] = {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": str(tmp_path / "run")},
    }
    config["data"]["init_args"].update(train_samples=4096, val_samples=1024)
    proc = run_cli("fit", "--config", str(write_config(tmp_path / "dlrm.yaml", config)), cwd=tmp_path)
    assert proc.returncode == 0, failure(proc)
    files = sorted((tmp_path / "run").rglob("metrics.csv"))
    with files[0].open() as handle:
        aurocs = [float(row["val_auroc"]) for row in csv.DictReader(handle) if row.get("val_auroc")]
    assert len(aurocs) == 2 and aurocs[-1] > 0.6, aurocs  # chance is 0.5
    assert _our_segments() <= before  # the node-shared tables are gone with the job


PIPELINE_CONFIG = ROOT / "examples" / "configs" / "hier_pipeline.yaml"


def test_pipeline_example_rebalances_live_and_learns(tmp_path: Path) -> None:
    config = yaml.safe_load(PIPELINE_CONFIG.read_text())
    config["trainer"].update(
        max_epochs=3, default_root_dir=str(tmp_path / "run"), enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
        config["trainer"]["logger"] = {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(tmp_path / "run")},
        }
    proc = run_cli("fit", "--config", str(write_config(tmp_path / "pipe.yaml", config)), cwd=tmp_path)
    assert proc.returncode == 0, failure(proc)
    accuracies = val_accuracies(tmp_path / "run")
    assert len(accuracies) == 3 and accuracies[-1] > 0.5, accuracies
    # the uniform start puts both 512-wide layers on stage 0: the first epoch's check moves layers
    events = json.loads(next((tmp_path / "run").rglob("pipeline_rebalance.json")).read_text())["rebalances"]
    assert events and events[0]["new"]["starts"] != events[0]["old"]["starts"]
    assert next((tmp_path / "run").rglob("pipeline_stage_times.png")).stat().st_size > 0
