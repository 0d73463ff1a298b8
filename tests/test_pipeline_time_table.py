"""pipeline/time_table.py: every stage's check measurements packed into one host row and merged back."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_hier.pipeline.time_table import merge_stage_times, pack_stage_times, row_size

# two stages of a 5-layer, 3-cluster graph as PipelineEngine.local_times reports them: stage 1 (rank 0)
# holds layers 3-4 / cluster 2, stage 0 (rank 1) layers 0-2 / clusters 0-1; layer 1 was not timed and
# layer 4 keeps nothing under the memory plan
STAGE_1 = {
    "layers": {3: (0.25, 0.5), 4: (1 / 3, 2 / 3)},
    "exit_bytes": {2: 0},
    "input_bytes": {3: 4096, 4: 2**40 + 3},
    "saved_bytes": {3: 1024},
}
STAGE_0 = {
    "layers": {0: (0.001, 0.002), 2: (0.1, 0.3)},
    "exit_bytes": {0: 512, 1: 2048},
    "input_bytes": {0: 0, 1: 128, 2: 256},
    "saved_bytes": {0: 64, 1: 32, 2: 16},
}


def test_rows_merge_into_the_table_the_last_stage_merged_from_pickled_objects() -> None:
    """Merged in rank order: the layer times of the timed layers only, every held layer's input bytes, the
    kept bytes where a stage reported them, each cluster's exit bytes, each row's (peak, capacity); floats
    and byte counts come back exactly (float64), and in the order the old dict merge produced."""
    rows = [pack_stage_times(STAGE_1, 5, 3, (7, 80)), pack_stage_times(STAGE_0, 5, 3)]
    assert rows[0].shape == (row_size(5, 3),) == (5 * 5 + 3 + 2,)
    merged = merge_stage_times(rows, 5, 3)
    expected_layers = {3: (0.25, 0.5), 4: (1 / 3, 2 / 3), 0: (0.001, 0.002), 2: (0.1, 0.3)}
    assert list(merged.table["layers"].items()) == list(expected_layers.items())
    assert merged.table["input_bytes"] == {3: 4096, 4: 2**40 + 3, 0: 0, 1: 128, 2: 256}
    assert merged.table["saved_bytes"] == {3: 1024, 0: 64, 1: 32, 2: 16}
    assert merged.exit_bytes == [512, 2048, 0]
    assert merged.memory == [(7, 80), (0, 0)]


def test_a_cluster_no_stage_measured_reads_zero_exit_bytes() -> None:
    only = {"layers": {}, "exit_bytes": {}, "input_bytes": {0: 8}, "saved_bytes": {}}
    merged = merge_stage_times([pack_stage_times(only, 1, 2)], 1, 2)
    assert merged.exit_bytes == [0, 0]
    assert merged.table == {"layers": {}, "input_bytes": {0: 8}, "saved_bytes": {}}


def test_an_untimed_layer_is_marked_apart_from_a_zero_time() -> None:
    """A layer timed at 0.0 s (a view, on a coarse clock) is in the table; one never timed is not."""
    local = {"layers": {0: (0.0, 0.0)}, "exit_bytes": {0: 4}, "input_bytes": {0: 1, 1: 1}, "saved_bytes": {}}
    row = pack_stage_times(local, 2, 1)
    assert row.dtype == torch.float64 and math.isnan(row[5 + 4].item())  # layer 1's kept bytes: none
    assert merge_stage_times([row], 2, 1).table["layers"] == {0: pytest.approx((0.0, 0.0))}
