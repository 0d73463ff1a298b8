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


def test_an_optimizer_kept_whole_resumes_exactly_and_under_ddp(results: dict) -> None:
    """Adafactor (not elementwise) stays whole on every rank; its checkpoint is its own state_dict and
    resumes under hier_sliced exactly, and under ddp; on hier_bsp's whole-parameter server it trains as
    under hier_sliced and resumes exactly."""
    assert results["whole_second_epoch_moved"] > 1e-3
    assert results["whole_resumed_vs_uninterrupted"] < 1e-6
    assert results["whole_ddp_resume_vs_uninterrupted"] < 1e-5
    # on hier_bsp's whole-parameter server (devices_per_node=1): as under hier_sliced (= ddp), and resumed
    assert results["whole_server_vs_hier_sliced_whole"] < 1e-5
    assert results["whole_server_resumed_vs_uninterrupted"] < 1e-6


def test_checkpoint_loads_into_plain_module(results: dict) -> None:
    assert results["plain_module_vs_saved"] == 0.0
    assert results["state_entries"] == results["num_params"]


def test_sharded_checkpoint_resumes_and_converts(results: dict) -> None:
    assert results["sharded_dirs"] == ["epoch=0-step=8.ckpt"]  # the step-4 directory was removed
    assert results["sharded_resumed_vs_uninterrupted"] < 1e-6
    assert results["sharded_converted_vs_half"] == 0.0
    assert results["sharded_vs_consolidated_optimizer_state"] == 0.0


def test_sharded_checkpoint_with_another_layout_is_refused_clearly(results: dict) -> None:
    assert "devices_per_node=2" in results["layout_error"]
    assert "consolidate_sharded_checkpoint" in results["layout_error"]


def test_time_plan_is_saved_and_resumed_without_profiling_again(results: dict) -> None:
    assert results["time_plan_saved"] and results["time_plan_restored"]
    assert results["time_plans_made_after_resume"] == 0  # no new profile: the saved plan drives the buckets
    assert results["time_buckets_after_resume"] == results["time_buckets_in_plan"]
    assert results["time_resumed_vs_uninterrupted"] < 1e-6
