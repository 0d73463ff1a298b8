"""Every stage's rebalance measurements in one fixed-size host tensor, gathered in one collective.

A rebalance check needs every stage's per-layer times and byte counts on every stage: each stage then
decides the same split and the same warm-up counts from the same table, without a message more. Pickled
objects (``gather_object`` to the last stage, then ``broadcast_object_list`` of its decision) cost four
collectives and their pickling: 3.6 ms per check on the first stage of the CPU benchmark, waiting on
the step's critical path. The table's size is known from the traced graph (its layers and clusters), so
one ``all_gather`` of a float64 row per stage carries it. float64 holds the times (Python floats) and the
byte counts (below 2**53) exactly, so every stage reads exactly what the measuring stage wrote.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# per layer: timed (1.0 or 0.0), mean forward s, mean backward s, input bytes, kept bytes; nan where the
# stage does not hold the layer (input bytes) or did not measure it (kept bytes)
_LAYER_COLUMNS = 5
_DEVICE_COLUMNS = 2  # the stage's peak allocated bytes and its device's capacity (0 on the host)


@dataclass
class GatheredTimes:
    """What a check reads, merged from every stage's row in rank order (the order the last stage merged
    the gathered objects in before)."""

    table: dict[str, dict[int, Any]] = field(
        default_factory=lambda: {"layers": {}, "input_bytes": {}, "saved_bytes": {}}
    )
    exit_bytes: list[int] = field(default_factory=list)
    memory: list[tuple[int, int]] = field(default_factory=list)  # (peak, capacity) per row, rank order


def row_size(num_layers: int, num_clusters: int) -> int:
    return num_layers * _LAYER_COLUMNS + num_clusters + _DEVICE_COLUMNS


def pack_stage_times(
    local: Mapping[str, Mapping[int, Any]],
    num_layers: int,
    num_clusters: int,
    memory: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """One stage's :meth:`PipelineEngine.local_times` (and its device memory) as a float64 host row."""
    layers = [[0.0, 0.0, 0.0, math.nan, math.nan] for _ in range(num_layers)]
    for i, (forward, backward) in local["layers"].items():
        layers[i][:3] = [1.0, float(forward), float(backward)]
    for i, value in local["input_bytes"].items():
        layers[i][3] = float(value)
    for i, value in local["saved_bytes"].items():
        layers[i][4] = float(value)
    exits = [math.nan] * num_clusters
    for c, value in local["exit_bytes"].items():
        exits[c] = float(value)
    flat = [v for layer in layers for v in layer] + exits + [float(memory[0]), float(memory[1])]
    return torch.tensor(flat, dtype=torch.float64)


def merge_stage_times(rows: Sequence[torch.Tensor], num_layers: int, num_clusters: int) -> GatheredTimes:
    """Every stage's rows (rank order) as one table: per-layer (forward, backward) of the timed layers,
    input and kept bytes, each cluster's exit bytes (0 where no stage measured it), each row's memory."""
    merged = GatheredTimes(exit_bytes=[0] * num_clusters)
    table = merged.table
    for row in rows:
        values = row.tolist()
        for i in range(num_layers):
            timed, forward, backward, input_bytes, kept = values[
                i * _LAYER_COLUMNS : (i + 1) * _LAYER_COLUMNS
            ]
            if timed:
                table["layers"][i] = (forward, backward)
            if not math.isnan(input_bytes):
                table["input_bytes"][i] = int(input_bytes)
            if not math.isnan(kept):
                table["saved_bytes"][i] = int(kept)
        exits = values[num_layers * _LAYER_COLUMNS : num_layers * _LAYER_COLUMNS + num_clusters]
        for c, value in enumerate(exits):
            if not math.isnan(value):
                merged.exit_bytes[c] = int(value)
        peak, capacity = values[-_DEVICE_COLUMNS:]
        merged.memory.append((int(peak), int(capacity)))
    return merged
