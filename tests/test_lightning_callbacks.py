"""Lightning's trainer features that steer a fit from outside the strategy (``EarlyStopping``,
``LearningRateMonitor``, ``GradientAccumulationScheduler``, ``reload_dataloaders_every_n_epochs``,
``overfit_batches``, ``Tuner.lr_find``, the best ``ModelCheckpoint`` under ``check_val_every_n_epoch``
then ``validate`` / ``test`` from it, ``barebones``, torchmetrics objects logged in the steps) give
``ddp``'s results under every strategy (tests/scripts/lightning_callbacks_checks.py, 2 processes: how
each strategy's reference reads the data).
"""

from __future__ import annotations

import json

import pytest
from helpers import run_torchrun

# each strategy against the ddp run that reads the same batches
REFERENCE = {"hier_sliced": "ddp", "hier_bsp": "ddp", "hier_pipeline": "ddp_user_shards"}
SCENARIOS = [
    "early_stopping",
    "accumulation_schedule",
    "reload_dataloaders",
    "overfit_batches",
    "best_checkpoint",
    "barebones",
    "metrics",
    "csv_logger",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("lightning_callbacks")
    run_torchrun("lightning_callbacks_checks.py", 2, str(out), timeout=400)
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("strategy", sorted(REFERENCE))
def test_trainer_features_end_where_ddp_ends(results: dict, strategy: str, scenario: str) -> None:
    reference, got = results[REFERENCE[strategy]][scenario], results[strategy][scenario]
    assert "error" not in reference, reference
    assert "error" not in got, got
    assert got.keys() == reference.keys()
    for key, value in reference.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, got[key], value)


def test_the_references_exercise_what_they_claim(results: dict) -> None:
    """EarlyStopping really stopped the fit early, the monitor saw the scheduler's decay, the accumulation
    schedule really halved the steps of its later epochs (8 batches per epoch: 8 + 8 + 4 + 4), the CSV
    holds every step, and the two ddp references read different batches (so agreeing with one is not
    agreeing with the other)."""
    for name in ("ddp", "ddp_user_shards"):
        stopped = results[name]["early_stopping"]
        assert stopped["stopped_epoch"] > 0 and stopped["epochs"] < 30, stopped
        assert stopped["rates"] == pytest.approx([0.2 * 0.7**epoch for epoch in range(stopped["epochs"])])
        assert results[name]["accumulation_schedule"]["global_step"] == 8 + 8 + 4 + 4
        logged = results[name]["csv_logger"]  # every step of 2 epochs, the epoch values at each epoch's end
        assert sorted(map(int, logged)) == list(range(16))
        assert {"train_loss_epoch", "val_loss"} <= logged["7"].keys() and "train_loss_step" in logged["7"]
    ddp, shards = results["ddp"]["reload_dataloaders"], results["ddp_user_shards"]["reload_dataloaders"]
    assert max(abs(a - b) for a, b in zip(ddp["params"], shards["params"])) > 1e-3


@pytest.mark.parametrize("strategy", sorted(REFERENCE))
def test_lr_find_runs_its_steps_and_restores_the_model(results: dict, strategy: str) -> None:
    """Its recorded loss is rank 0's own under ddp (Lightning does not reduce it), so for the pipeline,
    whose loss is the whole batch's, only the steps taken and the restore are compared."""
    reference, got = results[REFERENCE[strategy]]["lr_find"], results[strategy]["lr_find"]
    assert "error" not in got, got
    assert got["restored"] and reference["restored"]
    assert got["rates"] == pytest.approx(reference["rates"]) and len(got["rates"]) == 8
    if REFERENCE[strategy] == "ddp":
        assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5)


@pytest.mark.parametrize(
    "reduce_fx, on_epoch, expected",
    [
        ("mean", True, (1 * 2 + 4 * 2 + 7 * 4) / 8),
        ("max", False, 7.0),
        ("min", True, 1.0),
        ("sum", False, 12.0),
    ],
)
def test_a_step_value_logged_per_micro_batch_is_the_batchs(
    reduce_fx: str, on_epoch: bool, expected: float
) -> None:
    """What hier_pipeline's last stage does around a step's micro-batches: three calls of ``self.log`` (one
    per micro-batch, batch sizes 2, 2, 4) leave the step value their ``reduce_fx`` makes of them (Lightning
    alone keeps the last, 7.0); an epoch mean keeps accumulating every call."""
    import torch
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    from lightning_hier.strategies.lightning_patches import step_values_over_micro_batches

    results = _ResultCollection(training=True)
    with step_values_over_micro_batches(results):
        for value, size in ((1.0, 2), (4.0, 2), (7.0, 4)):
            results.log("training_step", "loss", torch.tensor(value), on_step=True, on_epoch=on_epoch,
                        reduce_fx=reduce_fx, batch_size=size)  # fmt: skip
    assert "update_metrics" not in vars(results)  # the collection's own method is back
    metric = results["training_step.loss"]
    assert float(metric._forward_cache) == pytest.approx(expected)
    if on_epoch and reduce_fx == "mean":
        assert float(metric.value) == pytest.approx(1 * 2 + 4 * 2 + 7 * 4)
        assert float(metric.cumulated_batch_size) == 8
