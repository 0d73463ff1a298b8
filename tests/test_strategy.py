"""HierSlicedStrategy as a Lightning strategy: registration, input validation, and agreement with
Lightning's own strategies (single-device on one process, ``ddp`` on 4 processes as 2 x 2) for
fit, validation inside fit, and ``trainer.validate`` / ``test`` / ``predict`` after fit.

Trainers that train run in torchrun subprocesses (``tests/scripts/strategy_checks.py``), so no
process group leaks into this pytest process.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
from helpers import run_torchrun
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

import lightning_hier
from lightning_hier import HierSlicedStrategy


# ---------------------------------------------------------------------------------------- registry
def test_importing_registers_hier_sliced_without_clobbering_ddp() -> None:
    assert lightning_hier.HierSlicedStrategy is HierSlicedStrategy
    assert "hier_sliced" in StrategyRegistry
    assert StrategyRegistry["hier_sliced"]["strategy"] is HierSlicedStrategy
    assert isinstance(StrategyRegistry.get("hier_sliced"), HierSlicedStrategy)
    # HierSlicedStrategy subclasses DDPStrategy; its register_strategies must not re-register DDP's names
    for name in ("ddp", "ddp_spawn", "ddp_find_unused_parameters_true"):
        assert StrategyRegistry[name]["strategy"] is DDPStrategy, name
        strategy = StrategyRegistry.get(name)
        assert type(strategy) is DDPStrategy, name

    trainer = Trainer(strategy="hier_sliced", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, HierSlicedStrategy)
    assert trainer.strategy.devices_per_node is None and trainer.strategy.slice_weights == "equal"
    assert type(Trainer(strategy="ddp", accelerator="cpu", devices=1, logger=False).strategy) is DDPStrategy
    assert not dist.is_initialized()


# ------------------------------------------------------------------------------ input validation
@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        (dict(devices_per_node=0), ["devices_per_node"]),
        (dict(devices_per_node=-2), ["devices_per_node"]),
        (dict(devices_per_node=True), ["devices_per_node"]),
        (dict(slice_weights="fast"), ["slice_weights", "'fast'", "equal"]),
        (dict(slice_weights=[1, 0]), ["slice_weights", "positive"]),
        (dict(slice_weights=[1, float("nan")]), ["slice_weights"]),
        (dict(slice_weights=[1, float("inf")]), ["slice_weights"]),
        (dict(slice_weights=["a", 1]), ["slice_weights"]),
        (dict(slice_weights=[1, 2, 3], devices_per_node=2), ["slice_weights", "devices_per_node=2", "3"]),
        (dict(bucket_cap_mb=0), ["bucket_cap_mb"]),
        (dict(bucket_cap_mb=-1.0), ["bucket_cap_mb"]),
    ],
)
def test_bad_settings_are_rejected_at_construction(kwargs: dict, names: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        HierSlicedStrategy(**kwargs)
    for name in names:
        assert name in str(info.value), (name, str(info.value))


def test_good_settings_are_kept() -> None:
    strategy = HierSlicedStrategy(devices_per_node=2, slice_weights=[3, 1], bucket_cap_mb=1)
    assert strategy.devices_per_node == 2
    assert strategy.slice_weights == [3.0, 1.0]
    assert strategy.bucket_cap_mb == 1.0
    assert HierSlicedStrategy(slice_weights="memory+compute").slice_weights == "memory+compute"


def _as_if_from_trainer(strategy: HierSlicedStrategy, num_processes: int) -> HierSlicedStrategy:
    """Set what Lightning's accelerator connector sets (``_lazy_init_strategy``), for a CPU launch."""
    strategy.parallel_devices = [torch.device("cpu")] * num_processes
    strategy.cluster_environment = LightningEnvironment()
    strategy.num_nodes = 1
    strategy.set_world_ranks()
    return strategy


@pytest.fixture
def no_process_group(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    for var in ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized()
    yield
    if dist.is_initialized():  # the check under test failed; do not leak the group into other tests
        dist.destroy_process_group()


def test_world_size_not_divisible_is_rejected_before_any_process_group(no_process_group: None) -> None:
    strategy = _as_if_from_trainer(HierSlicedStrategy(devices_per_node=2), num_processes=3)
    with pytest.raises(ValueError) as info:
        strategy.setup_distributed()
    message = str(info.value)
    assert "devices_per_node" in message and "3" in message
    assert "[1, 3]" in message, message  # the valid values for a world of 3
    assert not dist.is_initialized()


def test_slice_weights_for_the_inferred_node_size_are_checked_before_any_process_group(
    no_process_group: None,
) -> None:
    # devices_per_node=None takes the processes per host (2), so 3 weights cannot fit
    strategy = _as_if_from_trainer(HierSlicedStrategy(slice_weights=[1, 2, 3]), num_processes=2)
    with pytest.raises(ValueError, match="slice_weights"):
        strategy.setup_distributed()
    assert not dist.is_initialized()


# -------------------------------------------------------------------- one process vs single-device
@pytest.fixture(scope="module")
def single_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("strategy_single") / "results.json"
    run_torchrun("strategy_checks.py", 1, "single", str(out))
    return json.loads(out.read_text())


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_one_process_matches_single_device_strategy(single_results: dict, optimizer: str) -> None:
    result = single_results[optimizer]
    assert result["reference_strategy"] == "SingleDeviceStrategy"
    assert result["hier_strategy"] == "HierSlicedStrategy"
    assert result["steps"] == [6, 6]
    assert result["reference_moved"] > 1e-3
    assert result["max_rel_diff"] < 1e-5, result
    if optimizer == "adam":  # run with a tiny bucket cap: several buckets
        assert result["hier_buckets"] > 1


@pytest.mark.parametrize("variant", ["sgd", "adam_accumulate_clip", "raw_backward_accumulate"])
def test_manual_optimization_matches_single_device_strategy(single_results: dict, variant: str) -> None:
    """manual_backward, clip_gradients, accumulation, a dropped gradient and a scheduler stepped by hand."""
    result = single_results[f"manual_{variant}"]
    assert result["strategies"] == ["SingleDeviceStrategy", "HierSlicedStrategy"]
    assert result["steps_run"][0] == result["steps_run"][1] > 0
    # optimizer.zero_grad() unsets every .grad, as torch's does (no zeroed views left behind)
    reference, hier = result["grads_unset"]
    assert hier == reference and reference.count(True) > 1, result["grads_unset"]
    assert result["reference_moved"] > 1e-3
    assert result["max_rel_diff"] < 1e-5, result


# ------------------------------------------------------------------------ 4 processes (2 x 2) vs ddp
@pytest.fixture(scope="module")
def eval_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("strategy_eval") / "results.json"
    run_torchrun("strategy_checks.py", 4, "eval", str(out))
    return json.loads(out.read_text())


@pytest.mark.parametrize("variant", ["gan_toggle", "gan_no_toggle"])
def test_two_optimizers_gan_matches_ddp(eval_results: dict, variant: str) -> None:
    """A GAN's generator (Adam) and discriminator (SGD, clipped) each sharded over their own buckets:
    parameters and both optimizers' saved states as under ddp, whether each backward feeds one optimizer
    (toggle_optimizer) or both."""
    result = eval_results[variant]
    assert result["strategies"] == ["DDPStrategy", "HierSlicedStrategy"]
    assert result["steps_run"][0] == result["steps_run"][1] > 0
    assert result["reference_moved"] > 1e-3
    assert result["max_rel_diff"] < 1e-5, result
    assert result["optimizer_state_rel_diff"] < 1e-5, result


def test_two_optimizers_gan_matches_one_process(single_results: dict) -> None:
    result = single_results["gan_toggle"]
    assert result["strategies"] == ["SingleDeviceStrategy", "HierSlicedStrategy"]
    assert result["reference_moved"] > 1e-3
    assert result["max_rel_diff"] < 1e-5, result
    assert result["optimizer_state_rel_diff"] < 1e-5, result


@pytest.mark.parametrize("variant", ["sgd", "adam_accumulate_clip", "raw_backward_accumulate"])
def test_manual_optimization_matches_ddp(eval_results: dict, variant: str) -> None:
    """As under ddp on 4 processes (2 x 2, several buckets), with frozen, tied and unused parameters."""
    assert eval_results["world_size"] == 4
    result = eval_results[f"manual_{variant}"]
    assert result["strategies"] == ["DDPStrategy", "HierSlicedStrategy"]
    assert result["steps_run"][0] == result["steps_run"][1] > 0
    assert result["grads_unset"][1] == result["grads_unset"][0], result["grads_unset"]
    assert result["reference_moved"] > 1e-3
    assert result["max_rel_diff"] < 1e-5, result


@pytest.mark.parametrize("variant", ["plain", "batch_norm"])
def test_fit_matches_ddp_before_evaluation(eval_results: dict, variant: str) -> None:
    result = eval_results[variant]
    assert result["strategies"] == ["DDPStrategy", "HierSlicedStrategy"]
    assert result["reference_moved"] > 1e-3
    assert result["param_max_rel_diff"] < 1e-5, result


def test_validation_inside_fit_matches_ddp(eval_results: dict) -> None:
    result = eval_results["plain"]
    ddp, hier = result["fit_val_loss"]
    assert len(ddp) == len(hier) == 2  # val_check_interval=3, max_steps=6
    assert all(math.isfinite(v) for v in ddp + hier)
    assert result["fit_val_loss_rel_diff"] < 1e-5, result["fit_val_loss"]


def test_validation_inside_fit_with_batchnorm_matches_ddp(eval_results: dict) -> None:
    result = eval_results["batch_norm"]
    assert len(result["fit_val_loss"][0]) == len(result["fit_val_loss"][1]) == 2
    assert result["fit_val_loss_rel_diff"] < 1e-5, result["fit_val_loss"]


def _check_entry_point(result: dict, entry: str) -> None:
    assert result["errors"][entry] == [None, None], result["errors"][entry]
    if entry == "predict":
        assert result["num_predictions"] == [64.0, 64.0]
        assert result["prediction_scale"] > 1e-3
        assert result["prediction_max_abs_diff"] <= 1e-5 * result["prediction_scale"], result
    else:
        keys = ["val_loss", "val_acc"] if entry == "validate" else ["test_loss"]
        for key in keys:
            assert key in result["metric_rel_diff"], (key, result["metrics"])
            assert result["metric_rel_diff"][key] < 1e-5, (key, result["metrics"][key])


@pytest.mark.parametrize("entry", ["validate", "test", "predict"])
def test_entry_points_after_fit_match_ddp(eval_results: dict, entry: str) -> None:
    # without and with BatchNorm buffers: both strategies broadcast rank 0's states before evaluating
    for variant in ("plain", "batch_norm"):
        _check_entry_point(eval_results[variant], entry)


def test_an_optimizer_kept_whole_refuses_sharded_checkpoints_by_name() -> None:
    """A sharded checkpoint writes each rank's optimizer slices; an optimizer kept whole (Adafactor) has
    none, so the fit is refused at setup with the optimizer and the setting named."""
    from scripts.models import EquivModel, loader

    trainer = Trainer(
        accelerator="cpu", devices=1, strategy=HierSlicedStrategy(checkpoint_format="sharded"), max_steps=1,
        logger=False, enable_progress_bar=False, enable_checkpointing=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"keeps Adafactor whole .* checkpoint_format='sharded'"):
        trainer.fit(EquivModel(optimizer="adafactor"), loader())
