"""What the strategies replace on Lightning's objects for a run is Lightning's own again after the run
(tests/scripts/lightning_undo_checks.py; the reference is the same fit under Lightning's default strategy).

``hier_bsp`` off lockstep replaces the fit loop's ``on_advance_end`` and the optimizer's ``zero_grad``;
left in place, the fitted Trainer would not pickle (a local function on its fit loop) and the user's
``optimizer.zero_grad()`` after fit would reach the closed engine's gradient buckets.
"""

from __future__ import annotations

import json

import pytest
from helpers import run_torchrun


@pytest.fixture(scope="module")
def left_behind(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("undo") / "left_behind.json"
    run_torchrun("lightning_undo_checks.py", 1, str(out), timeout=300)
    return json.loads(out.read_text())


def test_the_reference_fit_replaces_nothing(left_behind: dict) -> None:
    reference = left_behind["reference"]
    assert reference["pickles"] == "yes"
    assert reference["plugin_class"] == ["Precision", "Precision"]
    assert all(reference[name] == [] for name in ("fit_loop", "epoch_loop", "precision_plugin", "module"))


@pytest.mark.parametrize("strategy", ["hier_sliced", "hier_bsp", "hier_pipeline"])
def test_a_fit_leaves_lightnings_objects_as_lightning_alone_does(left_behind: dict, strategy: str) -> None:
    assert left_behind[strategy] == left_behind["reference"]
