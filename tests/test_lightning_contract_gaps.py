"""Lightning-contract cases found by Lightning's own tests forced onto 2 CPU processes, where ``hier_sliced``
must end where ``ddp`` ends (tests/scripts/lightning_contract_checks.py, 2 processes)."""

from __future__ import annotations

import json

import pytest
from helpers import run_torchrun


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("lightning_contract")
    run_torchrun("lightning_contract_checks.py", 2, str(out), timeout=300)
    return json.loads((out / "results.json").read_text())


def test_an_optimizer_built_outside_configure_optimizers_survives_a_failed_fit(results: dict) -> None:
    """The first fit raises Lightning's own error on the unlogged monitor, as under ddp; the second, on a new
    Trainer with the same optimizer object, trains the module's parameters from the state the first fit
    left: ddp's parameters, optimizer state and plateau-reduced learning rate, and the optimizer holds the
    module's parameters again."""
    reference, got = (
        results["ddp"]["optimizer_built_outside"],
        results["hier_sliced"]["optimizer_built_outside"],
    )
    assert "error" not in reference, reference
    assert "error" not in got, got
    assert reference["first_error"].startswith("MisconfigurationException: ReduceLROnPlateau conditioned on")
    assert got["first_error"] == reference["first_error"]
    assert reference["holds_module_parameters"] and got["holds_module_parameters"]
    # 8 steps of the first fit and 3 x 8 of the second on one Adam state
    assert reference["steps"] == [32.0] * len(reference["steps"])
    assert got["steps"] == reference["steps"]
    assert reference["lr"] < 0.02 and got["lr"] == pytest.approx(reference["lr"])  # the plateau was seen
    assert got["params"] == pytest.approx(reference["params"], rel=1e-5, abs=1e-6)
    assert got["exp_avg_sq"] == pytest.approx(reference["exp_avg_sq"], rel=1e-5, abs=1e-9)


def test_the_progress_bar_of_a_loader_without_length_is_ddps_on_every_rank(results: dict) -> None:
    """``max_steps`` on an endless generator: rank 0's bar counts ``max_steps`` and rank 1's is disabled, as
    under ddp. Rank 1's ``RichProgressBar`` makes no training bar under either strategy, so Lightning's own
    tests that read ``train_progress_bar`` after the fit fail on rank 1 under ddp too."""
    reference, got = (
        results["ddp"]["progress_bar_without_length"],
        results["hier_sliced"]["progress_bar_without_length"],
    )
    assert "error" not in reference, reference
    assert "error" not in got, got
    # a disabled TQDMProgressBar still makes its (silent) training bar; a disabled RichProgressBar makes none
    assert reference["TQDMProgressBar"] == [
        {"enabled": True, "train_bar_total": 7},
        {"enabled": False, "train_bar_total": 7},
    ]
    if "RichProgressBar" in reference:
        assert reference["RichProgressBar"] == [
            {"enabled": True, "train_bar_total": 7},
            {"enabled": False, "train_bar_total": None},
        ]
    assert got == reference
