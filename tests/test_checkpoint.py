"""ModelCheckpoint-style save -> resume continues exactly where an uninterrupted run would be."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_torchrun


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    scratch: Path = tmp_path_factory.mktemp("ckpt")
    run_torchrun("checkpoint_resume.py", 4, str(scratch / "out.json"), str(scratch))
    return json.loads((scratch / "out.json").read_text())


def test_resume_matches_uninterrupted_run(results: dict) -> None:
    assert results["second_epoch_moved"] > 1e-3
    assert results["resumed_vs_uninterrupted"] < 1e-6


def test_consolidated_state_resumes_under_another_topology_and_under_ddp(results: dict) -> None:
    assert results["other_topology_vs_uninterrupted"] < 1e-5
    assert results["ddp_resume_vs_uninterrupted"] < 1e-5


def test_checkpoint_loads_into_plain_module(results: dict) -> None:
    assert results["plain_module_vs_saved"] == 0.0
    assert results["state_entries"] == results["num_params"]
