"""``start_method="spawn"``: Lightning's ``ddp_spawn`` launcher hands the trained module back to the
main process, as Lightning's own tests and notebooks use it.

Checked: ``HierPipelineStrategy`` pickles for the spawned workers (a lambda attribute would break that),
and the module handed back is whole and loads (during fit each worker holds only its own stage's layers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
from spawn_launch import EPOCHS, SpawnNet  # noqa: E402


def one_process(distributed_order: bool) -> tuple[dict[str, torch.Tensor], pl.Trainer]:
    torch.manual_seed(0)
    model = SpawnNet(distributed_order=distributed_order)
    trainer = pl.Trainer(
        use_distributed_sampler=False,
        accelerator="cpu",
        devices=1,
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model)
    return model.state_dict(), trainer


@pytest.mark.parametrize("strategy", ["hier_sliced", "hier_pipeline", "hier_bsp"])
def test_spawned_fit_hands_the_trained_module_back_like_one_process(strategy: str, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "spawn_launch.py"), strategy, str(out)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(out.read_text())
    # data-parallel strategies read batches as Lightning's DistributedSampler deals them; a pipeline
    # keeps the user's loader (one replica)
    expected, trainer = one_process(distributed_order=strategy != "hier_pipeline")
    got = torch.load(out.with_suffix(".pt"))
    assert set(got) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
    want = float(trainer.callback_metrics["val_loss"])
    assert abs(result["callback_metrics"]["val_loss"] - want) < 1e-5
    assert abs(result["validate"][0]["val_loss"] - want) < 1e-5
    assert Path(result["best_model_path"]).exists()
    assert result["restored_equals_best"] == dict.fromkeys(expected, True)
