"""A fitted Trainer pickles (``torch.save(trainer)``, ``copy.deepcopy``) under every strategy.

Each strategy holds process groups and engines, which would make pickling a Trainer after fit raise
``cannot pickle 'ProcessGroup'`` (Lightning's ``test_model_torch_save``). They are left out of the pickled
copy and rebuilt by the copy's next setup.
"""

from __future__ import annotations

import json

import pytest
from helpers import run_torchrun


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("pickling") / "results.json"
    run_torchrun("pickling_checks.py", 2, str(out), timeout=300)
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "name, cls",
    [
        ("hier_sliced", "HierSlicedStrategy"),
        ("hier_bsp", "HierBSPStrategy"),
        ("hier_pipeline", "HierPipelineStrategy"),
    ],
)
def test_fitted_trainer_pickles_and_still_checkpoints(results: dict, name: str, cls: str) -> None:
    result = results[name]
    assert result["copy_strategy"] == cls
    assert result["copy_engine"], "the copy must not carry the live engine"
    assert result["global_step"][0] == result["global_step"][1] > 0
    # the copy's module holds the trained weights (rank 0: a pipeline's stage 0 holds l1)
    assert result["copy_state_equal"] == result["keys"]
    # the original Trainer's checkpoint after pickling is the whole model with its optimizer
    assert result["checkpoint_keys"] == ["l1.bias", "l1.weight", "l2.bias", "l2.weight"]
    assert result["optimizer_states"] == 1
