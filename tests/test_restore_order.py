"""A checkpoint's callback states are restored before ``on_fit_start`` and ``fit(weights_only=False)`` reaches
``torch.load``, as under ``ddp`` (tests/scripts/restore_order_checks.py, 2 processes).

A restore that Lightning runs after the strategy's setup comes, in Lightning 2.6, after the
``on_fit_start`` hooks and without ``weights_only``. A regression would show as a resumed ``Timer`` taking
steps beyond its spent budget, ``StochasticWeightAveraging`` resumed with the user's ``LambdaLR`` raising
``KeyError: 'lr_lambdas'``, or a callback state holding a custom object failing to load ("Weights only load
failed").
"""

from __future__ import annotations

import json

import pytest
from helpers import run_torchrun

STRATEGIES = ["hier_sliced", "hier_bsp", "hier_pipeline"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("restore_order")
    run_torchrun("restore_order_checks.py", 2, str(out), timeout=400)
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_resumed_timer_with_its_budget_spent_takes_no_step_and_custom_objects_load(
    results: dict, strategy: str
) -> None:
    reference = results["reference"]["timer"]
    assert reference["resumed_step"] == reference["saved_step"] > 0 and reference["note"] == "kept", reference
    timer = results[strategy]["timer"]
    assert "error" not in timer, timer
    assert timer["saved_step"] > 0  # the first fit ran until the Timer stopped it
    assert timer["resumed_step"] == timer["saved_step"], timer
    assert timer["note"] == "kept"  # weights_only=False reached torch.load


@pytest.mark.parametrize("strategy", ["hier_sliced", "hier_bsp"])
def test_swa_resumed_with_the_users_scheduler_ends_where_ddp_ends(results: dict, strategy: str) -> None:
    reference, averaged = results["reference"]["swa"], results[strategy]["swa"]
    assert "error" not in reference and "error" not in averaged, averaged
    assert averaged == pytest.approx(reference, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("strategy", ["hier_sliced", "hier_bsp"])
def test_ema_resumed_ends_where_ddp_ends(results: dict, strategy: str) -> None:
    """The resumed fit starts from the trained weights that EMAWeightAveraging loads into the module from
    the checkpoint's ``current_model_state``, after the strategy loaded the averaged ones. Under hier_bsp
    (lockstep) the averaging in ``on_train_batch_end`` also sees the weights of the step just taken."""
    reference, averaged = results["reference"]["ema"], results[strategy]["ema"]
    assert "error" not in reference and "error" not in averaged, averaged
    assert averaged == pytest.approx(reference, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("strategy", ["hier_sliced", "hier_bsp"])
def test_on_load_checkpoint_runs_before_configure_optimizers_as_ddp(results: dict, strategy: str) -> None:
    """A consolidated checkpoint restores the module before the strategy's setup, where ddp restores it: a
    module that builds its optimizer from state restored in ``on_load_checkpoint`` sees the restored rate
    (a regression would show as configure_optimizers running first and seeing the constructor's)."""
    reference, resumed = results["reference"]["hook_order"], results[strategy]["hook_order"]
    assert "error" not in reference and "error" not in resumed, resumed
    assert reference["hooks"] == ["setup", "on_load_checkpoint", "configure_optimizers", "on_fit_start"]
    assert resumed["hooks"] == reference["hooks"]
    assert resumed["rate"] == reference["rate"] == 0.02
    assert resumed["params"] == pytest.approx(reference["params"], rel=1e-5, abs=1e-6)


def test_the_pipeline_restores_after_its_setup(results: dict) -> None:
    """hier_pipeline adopts the checkpoint's stage split, which needs its stages: it restores at the end of
    its setup, after configure_optimizers, and says so in its docs (the rate comes too late)."""
    resumed = results["hier_pipeline"]["hook_order"]
    assert "error" not in resumed, resumed
    assert resumed["hooks"] == ["setup", "configure_optimizers", "on_load_checkpoint", "on_fit_start"]
