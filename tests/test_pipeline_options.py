"""``HierPipelineStrategy``'s options: the ``Rebalance`` config (in Python and from a LightningCLI YAML),
``stages`` (a divisor of the processes), the tuning attributes, and ``StageRebalancer`` holding none of the
strategy's settings."""

from __future__ import annotations

import inspect
import math
import os
import sys
import warnings
from pathlib import Path
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch.distributed as dist
import yaml
from helpers import DDP_PLUMBING
from lightning.pytorch.cli import LightningCLI
from scripts.models import EquivModel, loader

from lightning_hier import HierPipelineStrategy, Rebalance, StageRebalancer
from lightning_hier.pipeline.settings import PipelineSettings


def test_the_strategy_has_at_most_twelve_options_of_its_own() -> None:
    own = [name for name in inspect.signature(HierPipelineStrategy).parameters if name not in DDP_PLUMBING]
    assert len(own) <= 12, own
    for moved in ("imbalance_threshold", "balance_tolerance", "min_rebalance_gain", "swap_bandwidth",
                  "extra_warmup", "split_backward"):  # fmt: skip
        assert moved not in own


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"every": 0}, "Rebalance.every .* got 0"),
        ({"every": "always"}, "Rebalance.every .* got 'always'"),
        ({"every": True}, "Rebalance.every .* got True"),
        ({"imbalance_threshold": -0.5}, r"Rebalance.imbalance_threshold .* got -0\.5"),
        ({"imbalance_threshold": math.inf}, "Rebalance.imbalance_threshold .* got inf"),
        ({"balance_tolerance": -1.0}, r"Rebalance.balance_tolerance .* got -1\.0"),
        ({"min_gain": 1.5}, r"Rebalance.min_gain must be in \[0, 1\), got 1\.5"),
        ({"min_gain": -0.1}, r"Rebalance.min_gain must be in \[0, 1\), got -0\.1"),
    ],
)
def test_a_bad_rebalance_field_is_refused_naming_the_field_and_value(fields: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        Rebalance(**fields)
    if set(fields) == {"every"}:  # the short form of the strategy's rebalance says the same
        with pytest.raises(ValueError, match=named):
            HierPipelineStrategy(rebalance=fields["every"])


def test_rebalance_reaches_the_settings_the_engine_reads() -> None:
    strategy = HierPipelineStrategy(
        rebalance=Rebalance(every=5, imbalance_threshold=0.3, balance_tolerance=0.04, min_gain=0.2)
    )
    settings = strategy.settings
    assert (settings.rebalance, settings.imbalance_threshold) == (5, 0.3)
    assert (settings.balance_tolerance, settings.min_rebalance_gain) == (0.04, 0.2)
    # the short forms keep the default thresholds
    for short in ("epoch", "never", 7):
        assert HierPipelineStrategy(rebalance=short).settings.rebalance_config() == Rebalance(every=short)
    assert Rebalance() == Rebalance("epoch", 0.1, 0.02, 0.05)


def _cli_config(rebalance: object) -> dict:
    return {
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "logger": False,
            "enable_checkpointing": False,
            "strategy": {
                "class_path": "lightning_hier.HierPipelineStrategy",
                "init_args": {"micro_batches": 2, "rebalance": rebalance},
            },
            "callbacks": [
                {"class_path": "lightning_hier.StageRebalancer", "init_args": {"save_figure": False}}
            ],
        },
        "model": {"class_path": "lightning_hier.examples.digits.DigitsPipelineClassifier"},
        "data": {"class_path": "lightning_hier.examples.digits.DigitsDataModule"},
    }


def _cli(config: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LightningCLI:
    monkeypatch.setattr(sys, "argv", ["lightning_hier"])  # the config below is the whole command line
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return LightningCLI(
        subclass_mode_model=True, subclass_mode_data=True, run=False, args=["--config", str(path)]
    )


def test_lightning_cli_builds_rebalance_from_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``rebalance: {class_path: lightning_hier.Rebalance, init_args: ...}`` in a config (no process starts:
    the Trainer is only built)."""
    rebalance = {
        "class_path": "lightning_hier.Rebalance",
        "init_args": {"every": 4, "imbalance_threshold": 0.25, "min_gain": 0.1},
    }
    strategy = _cli(_cli_config(rebalance), tmp_path, monkeypatch).trainer.strategy
    assert isinstance(strategy, HierPipelineStrategy)
    expected = Rebalance(every=4, imbalance_threshold=0.25, balance_tolerance=0.02, min_gain=0.1)
    assert strategy.settings.rebalance_config() == expected
    assert strategy.settings.micro_batches == 2


def test_lightning_cli_refuses_a_bad_rebalance_field_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused while the Trainer is built (LightningCLI builds the strategy then), before any process."""
    rebalance = {"class_path": "lightning_hier.Rebalance", "init_args": {"every": 4, "min_gain": 1.5}}
    with pytest.raises(ValueError, match=r"Rebalance.min_gain must be in \[0, 1\), got 1\.5"):
        _cli(_cli_config(rebalance), tmp_path, monkeypatch)


def test_stages_must_divide_the_processes(tmp_path: Path) -> None:
    """``stages`` is the stages per pipeline replica: a divisor of the processes is accepted without a warning
    (the processes run that many replicas), another number is refused before any process group exists."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        same = HierPipelineStrategy(stages=1, micro_batches=2)
    same.settings.check_world_size(1)  # no error: one process, one stage
    same.settings.check_world_size(4)  # four replicas of one stage
    assert "stages" in inspect.signature(HierPipelineStrategy).parameters
    assert inspect.signature(HierPipelineStrategy).parameters["stages"].kind is inspect.Parameter.KEYWORD_ONLY

    other = HierPipelineStrategy(stages=2)
    with mock.patch.dict(os.environ):  # Lightning sets MASTER_PORT and LOCAL_RANK: none left for later tests
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, strategy=other, max_steps=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=tmp_path,
        )  # fmt: skip
        with pytest.raises(ValueError, match=r"stages=2 but the Trainer launches 1 process.*must divide"):
            trainer.fit(EquivModel(), train_dataloaders=loader())
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("name", "value", "bad"),
    [("_split_backward", True, "yes"), ("_extra_warmup", 2, -1), ("_swap_bandwidth", 1e9, 0.0)],
)
def test_tuning_attributes_reach_the_settings_and_are_validated(
    name: str, value: object, bad: object
) -> None:
    field = name.lstrip("_")  # the engine's setting of the same name
    strategy = HierPipelineStrategy()
    assert getattr(strategy, name) == getattr(PipelineSettings(), field)  # the default
    setattr(strategy, name, value)
    assert getattr(strategy.settings, field) == value  # what the engine is built with
    with pytest.raises(ValueError, match=field):
        setattr(strategy, name, bad)
    assert getattr(strategy.settings, field) == value


def test_stage_rebalancer_holds_none_of_the_strategys_settings() -> None:
    """One place to set each: the callback only adds what it writes (the figure, the directory)."""
    callback = set(inspect.signature(StageRebalancer).parameters)
    strategy = set(inspect.signature(HierPipelineStrategy).parameters)
    assert callback == {"save_figure", "output_dir"}
    assert not callback & strategy
    assert not callback & {f.name for f in PipelineSettings.__dataclass_fields__.values()}


def test_sync_batchnorm_is_refused_across_replicas(tmp_path: Path) -> None:
    """Two replicas of a one-stage pipeline would leave each replica's BatchNorm unsynchronized: refused
    before any process group, naming the alternative; one replica warns and runs (nothing to synchronize)."""
    with mock.patch.dict(os.environ):
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy=HierPipelineStrategy(stages=1), sync_batchnorm=True,
            logger=False, enable_checkpointing=False, default_root_dir=tmp_path,
        )  # fmt: skip
        strategy = trainer.strategy
        strategy._lightning_module = EquivModel(batch_norm=True)
        refusal = r"stages=1\) on 2 processes \(2 replicas\).*use hier_sliced or ddp"
        with pytest.raises(ValueError, match=refusal):
            strategy._validate_before_process_group()
        one_replica = pl.Trainer(
            accelerator="cpu", devices=2, strategy=HierPipelineStrategy(stages=2), sync_batchnorm=True,
            logger=False, enable_checkpointing=False, default_root_dir=tmp_path,
        )  # fmt: skip
        one_replica.strategy._lightning_module = EquivModel(batch_norm=True)
        with pytest.warns(UserWarning, match="nothing to synchronize"):
            one_replica.strategy._validate_before_process_group()
    assert not dist.is_initialized()
