"""``16-mixed`` under hier_sliced: the loss scale never reaches the embedding table, and a step
the scaler skips is skipped for the dense parameters and the table alike (2 gloo processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import run_torchrun


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    scratch: Path = tmp_path_factory.mktemp("amp")
    run_torchrun("amp_checks.py", 2, str(scratch / "out.json"))
    return json.loads((scratch / "out.json").read_text())


def test_table_updates_do_not_depend_on_the_loss_scale(results: dict) -> None:
    scaled, unscaled = results["scaled"], results["unscaled"]
    assert [s["scale"] for s in scaled] == [1024.0, 4096.0, 4096.0, 16384.0]  # the user's growth settings
    assert [s["scale"] for s in unscaled] == [1.0, 4.0, 4.0, 16.0]
    initial_moved = False
    for a, b in zip(scaled, unscaled):
        table_a, table_b = torch.tensor(a["table"]), torch.tensor(b["table"])
        torch.testing.assert_close(table_a, table_b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(a["head"]), torch.tensor(b["head"]), rtol=1e-5, atol=1e-6)
        initial_moved = initial_moved or not torch.equal(table_a, torch.tensor(scaled[0]["table"]))
    assert initial_moved, "the table must change during training for the comparison to mean anything"
    assert results["tables_equal_across_nodes"]


def test_a_step_skipped_by_the_scaler_leaves_table_and_dense_parameters_untouched(results: dict) -> None:
    before, poisoned, after = results["overflow"][1:4]  # rank 1's embedding gradient is inf on step 2
    assert all(torch.isfinite(torch.tensor(s["table"])).all() for s in results["overflow"])
    assert poisoned["table"] == before["table"], "the table was updated on a skipped step"
    assert poisoned["head"] == before["head"], "the dense step was not skipped (rank 0 never saw the inf)"
    assert poisoned["scale"] == before["scale"] / 2  # backoff_factor 0.5: the scaler saw the overflow
    assert after["table"] != poisoned["table"] and after["head"] != poisoned["head"]  # training goes on


def test_the_installed_scaler_keeps_the_users_settings(results: dict) -> None:
    settings = results["settings"]
    assert settings["is_hier"], settings["type"]
    kept = (settings["growth_factor"], settings["backoff_factor"], settings["growth_interval"])
    assert kept == (4.0, 0.5, 2)
