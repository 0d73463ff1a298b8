"""During a ``hier_sliced`` fit, the user's optimizer object (``trainer.optimizers[0]``, what
``configure_optimizers`` returned) answers ``state_dict()`` as under ``ddp``: the per-parameter layout
(``params`` index lists as the groups were built, state per index shaped like each parameter), the same on
every rank and equal to the checkpoint's ``optimizer_states``; and ``load_state_dict()`` of such a dict
during the fit loads it, training on as ``ddp`` does. Lightning's
``test_trainer_properties_restore_ckpt_path`` compares the same in ``on_train_start`` of a resumed fit. Two
gloo CPU processes
(``tests/scripts/optimizer_state_dict_checks.py``); ``ddp`` is the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import run_torchrun

RANKS = (0, 1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out: Path = tmp_path_factory.mktemp("optimizer_state_dict")
    run_torchrun("optimizer_state_dict_checks.py", 2, str(out), timeout=600)
    records = {
        (name, rank): torch.load(out / f"{name}-rank{rank}.pt", weights_only=False)
        for name in ("ddp", "hier_sliced")
        for rank in RANKS
    }
    checkpoints = {
        name: torch.load(out / name / "epoch1.ckpt", weights_only=False)["optimizer_states"][0]
        for name in ("ddp", "hier_sliced")
    }
    return {"records": records, "checkpoints": checkpoints}


def assert_same_state_dict(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Keys, shapes, dtypes and values of every state entry, and every param group's settings and indices."""
    assert sorted(actual) == sorted(expected) == ["param_groups", "state"]
    assert sorted(actual["state"]) == sorted(expected["state"])
    for index, entry in expected["state"].items():
        got = actual["state"][index]
        assert sorted(got) == sorted(entry), index
        for key, value in entry.items():
            if torch.is_tensor(value):
                assert torch.is_tensor(got[key]), (index, key)
                assert got[key].shape == value.shape and got[key].dtype == value.dtype, (index, key)
                torch.testing.assert_close(got[key], value, rtol=1e-9, atol=1e-12, msg=f"{index} {key}")
            else:
                assert got[key] == value, (index, key)
    assert len(actual["param_groups"]) == len(expected["param_groups"])
    for got, group in zip(actual["param_groups"], expected["param_groups"]):
        assert got == group  # hyperparameters (lr after the scheduler's step, betas, ...) and 'params'


@pytest.mark.parametrize("moment", ["epoch_end", "on_train_start", "wrapper_epoch_end"])
@pytest.mark.parametrize("rank", RANKS)
def test_state_dict_during_fit_is_ddps(runs: dict[str, Any], moment: str, rank: int) -> None:
    """In ``on_train_epoch_end`` after one epoch (also through the ``LightningOptimizer`` that
    ``self.optimizers()`` returns) and in ``on_train_start`` of a resumed fit: ddp's dict, on every rank;
    the bias of 32 elements has state of 32 elements, not the slice layout."""
    records = runs["records"]
    expected = records["ddp", rank][moment]
    actual = records["hier_sliced", rank][moment]
    assert expected["state"][1]["exp_avg"].shape == (32,)  # the first layer's bias
    assert expected["param_groups"][1]["params"] == [2, 3]
    assert_same_state_dict(actual, expected)


@pytest.mark.parametrize("moment", ["epoch_end", "on_train_start"])
def test_state_dict_during_fit_equals_the_checkpoint(runs: dict[str, Any], moment: str) -> None:
    """As Lightning's ``test_trainer_properties_restore_ckpt_path`` checks: what the object answers equals
    the checkpoint's ``optimizer_states[0]``, which checkpointing consolidated once per save."""
    for rank in RANKS:
        record = runs["records"]["hier_sliced", rank]
        assert_same_state_dict(record[moment], runs["checkpoints"]["hier_sliced"])
        assert record["consolidations_per_save"] == 1
    assert_same_state_dict(runs["checkpoints"]["hier_sliced"], runs["checkpoints"]["ddp"])


@pytest.mark.parametrize("rank", RANKS)
def test_load_state_dict_during_fit_loads_the_per_parameter_layout(runs: dict[str, Any], rank: int) -> None:
    """``optimizer.load_state_dict(checkpoint["optimizer_states"][0])`` in ``on_train_start`` of a fresh fit:
    ``state_dict()`` then answers what was loaded, and the epoch trained from it ends where ddp's does."""
    record = runs["records"]["hier_sliced", rank]
    reference = runs["records"]["ddp", rank]
    assert "load_error" not in record, record.get("load_error")
    assert_same_state_dict(record["after_load"], runs["checkpoints"]["hier_sliced"])
    assert_same_state_dict(record["after_load"], reference["after_load"])
    for name, value in reference["loaded_fit_params"].items():
        torch.testing.assert_close(record["loaded_fit_params"][name], value, rtol=1e-9, atol=1e-12, msg=name)
