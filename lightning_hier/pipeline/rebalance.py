"""The imbalance test and the new partition, decided on every stage alike from the gathered times."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_hier.pipeline.graph import LayerGraph
from lightning_hier.pipeline.partition import (
    StagePartition,
    imbalance,
    partition_balanced,
    stage_costs,
)


def cluster_costs(graph: LayerGraph, layer_times: Mapping[int, tuple[float, float]]) -> list[float]:
    """Forward + backward seconds per cluster (per micro-batch) from per-layer means."""
    costs = []
    for cluster in graph.clusters:
        total = 0.0
        for layer in range(cluster.start, cluster.end):
            forward, backward = layer_times.get(layer, (0.0, 0.0))
            total += forward + backward
        costs.append(total)
    return costs


@dataclass(frozen=True)
class RebalanceDecision:
    """What every stage concluded at one check (the same table, so the same conclusion); ``new`` is
    ``None`` when nothing changes."""

    old: StagePartition
    new: StagePartition | None
    stage_times: tuple[float, ...]
    predicted_times: tuple[float, ...]
    reason: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def imbalance_before(self) -> float:
        return imbalance(self.stage_times)

    @property
    def imbalance_after(self) -> float:
        return imbalance(self.predicted_times)


def decide_rebalance(
    graph: LayerGraph,
    partition: StagePartition,
    layer_times: Mapping[int, tuple[float, float]],
    exit_bytes: Sequence[int],
    threshold: float,
    tolerance: float = 0.02,
    force: bool = False,
    min_gain: float = 0.05,
) -> RebalanceDecision:
    """Repartition when ``(max - min) / mean`` of stage times exceeds ``threshold`` (or ``force``).

    The new split minimises the slowest stage; among splits within ``tolerance`` of that, the
    fewest bytes crossing stage boundaries wins. A split equal to the current one, or one that
    would not make the slowest stage at least ``min_gain`` faster, is not applied: without that
    margin two near-equal splits take turns on measurement noise, each migration costing a pause.
    """
    costs = cluster_costs(graph, layer_times)
    times = tuple(stage_costs(partition, costs))
    spread = imbalance(times)
    if not force and spread <= threshold:
        return RebalanceDecision(partition, None, times, times, f"balanced ({spread:.3f} <= {threshold})")
    cut_bytes = list(exit_bytes[: graph.num_clusters - 1])
    candidate = partition_balanced(costs, partition.num_stages, cut_bytes, tolerance)
    predicted = tuple(stage_costs(candidate, costs))
    if candidate.starts == partition.starts:
        return RebalanceDecision(partition, None, times, times, "the best split is the current one")
    if not force and max(predicted) > (1.0 - min_gain) * max(times):
        return RebalanceDecision(
            partition, None, times, times, f"no split makes the slowest stage {min_gain:.0%} faster"
        )
    reason = "split from measured times" if force else f"imbalance {spread:.3f} > {threshold}"
    return RebalanceDecision(partition, candidate, times, predicted, reason)
