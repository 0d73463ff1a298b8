"""bench_pipeline.py's report (median over rounds) and its GPT-2 anchor (torch's hand-built stages)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_pipeline  # noqa: E402


def _job(contender: str, repeat: int, samples_per_s: float) -> bench_pipeline.Job:
    worker = {
        "samples_per_s": samples_per_s,
        "first_loss": 1.0,
        "other_cores": 0.0,
        "max_mean_before": 1.5,
        "max_mean_after": 1.1,
        "pause_s": 0.01,
        "engine_overhead_ms_per_micro_batch": 0.3,
        "engine_overhead_without_optimizer_ms_per_micro_batch": 0.2,
        "engine_own_ms_per_micro_batch": 0.1,
        "ideal_step_s": 0.1,
        "first_stage_boundary_s": 0.01,
        "balanced_ideal_step_s": 0.1,
        "history": [],
    }
    return bench_pipeline.Job(contender, 2, repeat, 1, worker=worker)


def test_summary_reports_the_median_of_each_rounds_ratio() -> None:
    """Three rounds whose rebalanced / torch-on-the-same-split ratios are 0.5, 1.1 and 1.2: the median is
    1.1 (their mean 0.933, the ratio of the mean rates 1.0); samples/s are each contender's median."""
    rates = {
        "single": [100.0, 100.0, 100.0],
        "uniform": [100.0, 100.0, 100.0],
        "rebalanced": [100.0, 220.0, 240.0],
        "pipelining": [100.0, 200.0, 200.0],
        "pipelining_hier_split": [200.0, 200.0, 200.0],
    }
    done = [_job(c, r, rate) for r in range(3) for c, values in rates.items() for rate in [values[r]]]
    result = bench_pipeline.summary(2, done, done, batch_size=64)
    ratio = result["ratios"]["rebalanced_vs_pipelining_same_split"]
    assert ratio["rounds"] == pytest.approx([0.5, 1.1, 1.2])
    assert ratio["median"] == pytest.approx(1.1)
    assert ratio["spread"] == pytest.approx(0.7)
    assert result["rebalanced_vs_pipelining_same_split"] == pytest.approx(1.1)
    assert result["rebalanced_vs_single"] == pytest.approx(2.2)
    assert result["samples_per_s"]["rebalanced"] == pytest.approx(220.0)
    assert "1.10x [rounds 0.50, 1.10, 1.20; spread 0.70]" in result["verdict"]


def test_a_failed_round_is_left_out_of_the_median() -> None:
    done = [_job(c, r, 100.0 * (r + 1)) for r in range(3) for c in ("rebalanced", "uniform")]
    done[0] = bench_pipeline.Job("rebalanced", 2, 0, 1, ok=False, error="x")
    ratio = bench_pipeline.rounds_ratio(done, "rebalanced", "uniform")
    assert ratio["median"] == pytest.approx(1.0)
    assert len(ratio["rounds"]) == 3 and ratio["rounds"][0] != ratio["rounds"][0]  # nan for the failed one


# the module of each cluster's first layer, as hier_pipeline's torch.export capture groups GPT2LMHeadModel
OWNERS = [
    "model.transformer",
    "model.transformer.wte",
    "model.transformer",
    "model.transformer.drop",
    "model.transformer.h.0",
    "model.transformer.h.1",
    "model.transformer.h.2",
    "model.transformer.h.3",
    "model.transformer.ln_f",
    "model.transformer",
    "model",
    "model.lm_head",
]


def test_gpt2_hand_built_stages_compute_the_models_logits() -> None:
    """torch's hand-built stages on each split the engine can end with, run in a row, give GPT2LMHeadModel's
    own logits, and stage k begins where the engine's stage k does."""
    pytest.importorskip("transformers")
    import _pipeline_gpt2 as gpt2

    model = gpt2.gpt2()
    x, _ = gpt2.make_batches(2)[0]
    with torch.no_grad():
        reference = model(input_ids=x, use_cache=False).logits
    first_piece = {4: 1, 5: 2, 6: 3, 7: 4, 8: 5, 9: 6, 10: 6, 11: 6}  # cluster -> piece (lm_head: 6)
    for starts in ([0, 4], [0, 6], [0, 7], [0, 8], [0, 9], [0, 11], [0, 5, 8], [0, 5, 6, 7]):
        pieces = gpt2.pieces_of_split(starts, OWNERS)
        assert pieces == [0, *(first_piece[s] for s in starts[1:])]
        out = x
        with torch.no_grad():
            for stage in gpt2.hand_stages(model, pieces):
                out = stage(out)
        torch.testing.assert_close(out, reference, rtol=0, atol=0, msg=f"split {starts}")


def test_gpt2_no_hand_built_stage_begins_inside_the_embeddings() -> None:
    pytest.importorskip("transformers")
    import _pipeline_gpt2 as gpt2

    with pytest.raises(ValueError, match="embeddings"):
        gpt2.pieces_of_split([0, 2], OWNERS)
