"""Contiguous splits of a model's clusters into pipeline stages.

A traced model is a list of *clusters* in execution order (contiguous runs of layers with one entry
and one exit). A pipeline partition cuts that list into ``K`` contiguous, non-empty stages; stage
``s`` runs clusters ``[starts[s], starts[s + 1])``.

:func:`partition_balanced` picks the split: among all splits whose slowest stage is within
``tolerance`` of the best achievable, it takes the one that sends the fewest bytes across stage
boundaries. The search is exact (dynamic programming over integers scaled from the costs), so equal
sums compare equal and the result does not depend on float rounding.

Plain Python, no torch: the module can be used offline to plan or to inspect a partition.
"""

from __future__ import annotations

import math
import numbers
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from itertools import accumulate

# Added to the cost limit (relative to the best max stage cost) so that a split as good as the best
# one is never excluded by a rounding difference in how a caller computed the costs.
_RELATIVE_EPSILON = Fraction(1e-12)


@dataclass(frozen=True)
class StagePartition:
    """Contiguous split of ``num_clusters`` clusters into stages.

    ``starts[s]`` is the first cluster of stage ``s``; stage ``s`` ends where stage ``s + 1`` starts
    (the last stage ends at ``num_clusters``). ``starts[0] == 0`` and the starts strictly increase,
    so no stage is empty. Lists passed as ``starts`` are stored as a tuple.
    """

    starts: tuple[int, ...]
    num_clusters: int

    def __post_init__(self) -> None:
        num_clusters = _whole("num_clusters", self.num_clusters)
        if num_clusters < 1:
            raise ValueError(f"num_clusters={num_clusters} is invalid; a partition covers >= 1 cluster.")
        starts = tuple(_whole("starts", start) for start in self.starts)
        _check_starts(starts, num_clusters)
        object.__setattr__(self, "starts", starts)
        object.__setattr__(self, "num_clusters", num_clusters)

    @property
    def num_stages(self) -> int:
        """Number of pipeline stages."""
        return len(self.starts)

    def stage_ranges(self) -> list[tuple[int, int]]:
        """``[(start, end), ...]``: the half-open cluster range ``[start, end)`` of each stage."""
        ends = self.starts[1:] + (self.num_clusters,)
        return list(zip(self.starts, ends))

    def stage_of_cluster(self, cluster: int) -> int:
        """Index of the stage that runs ``cluster``."""
        if not 0 <= cluster < self.num_clusters:
            raise ValueError(f"cluster={cluster} is outside [0, num_clusters={self.num_clusters}).")
        return bisect_right(self.starts, cluster) - 1

    def to_dict(self) -> dict:
        """JSON-friendly form: ``{"starts": [...], "num_clusters": n}``."""
        return {"starts": list(self.starts), "num_clusters": self.num_clusters}

    @classmethod
    def from_dict(cls, d: Mapping) -> StagePartition:
        """Rebuild (and re-validate) a partition written by :meth:`to_dict`."""
        missing = [key for key in ("starts", "num_clusters") if key not in d]
        if missing:
            raise ValueError(f"partition dict {dict(d)!r} lacks {missing}; needs 'starts', 'num_clusters'.")
        return cls(starts=tuple(d["starts"]), num_clusters=d["num_clusters"])

    def __str__(self) -> str:
        return "clusters " + " | ".join(f"[{start},{end})" for start, end in self.stage_ranges())


def stage_costs(partition: StagePartition, cluster_costs: Sequence[float]) -> list[float]:
    """Total cost of each stage: the sum of its clusters' costs (summed without rounding drift)."""
    _check_length("cluster_costs", cluster_costs, partition.num_clusters, "one per cluster")
    return [math.fsum(cluster_costs[start:end]) for start, end in partition.stage_ranges()]


def boundary_bytes(partition: StagePartition, cut_bytes: Sequence[int]) -> int:
    """Bytes that cross stage boundaries: the sum of ``cut_bytes`` at the partition's cuts.

    ``cut_bytes[i]`` is what flows across the cut between cluster ``i`` and cluster ``i + 1``.
    """
    cuts = _check_cut_bytes(cut_bytes, partition.num_clusters)
    return sum(cuts[start - 1] for start in partition.starts[1:])


def imbalance(stage_times: Sequence[float]) -> float:
    """Spread of the stage times relative to their mean, ``(max - min) / mean``.

    0.0 means perfectly balanced (also returned for a single stage or all-zero times).
    """
    times = _check_costs("stage_times", stage_times)
    if not times:
        raise ValueError("stage_times is empty; pass one time per stage.")
    mean = math.fsum(times) / len(times)
    if len(times) == 1 or mean == 0:
        return 0.0
    return (max(times) - min(times)) / mean


def partition_balanced(
    cluster_costs: Sequence[float],
    num_stages: int,
    cut_bytes: Sequence[int] | None = None,
    tolerance: float = 0.02,
) -> StagePartition:
    """Split the clusters into ``num_stages`` contiguous stages, balanced first, cheap to cut second.

    Let ``M*`` be the smallest achievable cost of the slowest stage. Every split whose slowest stage
    costs at most ``M* * (1 + tolerance)`` (plus ``1e-12 * M*``) is acceptable; of those you get the
    one with the fewest bytes crossing its cuts, then the one with the cheaper slowest stage, then
    the one with the lexicographically smallest ``starts``. ``cut_bytes=None`` means cuts are free,
    so you get the best-balanced split. The answer is exact, not a heuristic.

    Args:
        cluster_costs: cost (time, FLOPs, ...) of each cluster; finite and ``>= 0``.
        num_stages: number of stages, between 1 and ``len(cluster_costs)``.
        cut_bytes: ``len(cluster_costs) - 1`` non-negative byte counts, one per possible cut.
        tolerance: how much slower than ``M*`` the slowest stage may be to save bytes (0.02 = 2%).
    """
    stages = _check_num_stages(num_stages)
    costs = _check_costs("cluster_costs", cluster_costs)
    _check_stage_count(stages, len(costs), "cluster_costs")
    cuts = [0] * (len(costs) - 1) if cut_bytes is None else _check_cut_bytes(cut_bytes, len(costs))
    tol = _check_tolerance(tolerance)
    return _solve(_scaled_integers(costs), stages, cuts, tol)


def partition_uniform(num_items_per_cluster: Sequence[int], num_stages: int) -> StagePartition:
    """Uniform-count split: stages hold as equal a number of layers as contiguity allows.

    Same as :func:`partition_balanced` with the layer counts as costs, free cuts and no tolerance.
    """
    stages = _check_num_stages(num_stages)
    counts = _check_costs("num_items_per_cluster", num_items_per_cluster)
    for index, count in enumerate(counts):
        if not isinstance(count, numbers.Integral):
            raise ValueError(f"num_items_per_cluster[{index}]={count!r} is not a whole number of layers.")
    _check_stage_count(stages, len(counts), "num_items_per_cluster")
    return _solve([int(count) for count in counts], stages, [0] * (len(counts) - 1), Fraction(0))


# --- the exact search -----------------------------------------------------------------------------


def _solve(costs: list[int], num_stages: int, cuts: list[int], tolerance: Fraction) -> StagePartition:
    """Exact split for integer ``costs`` (see :func:`partition_balanced` for the criterion)."""
    prefix = list(accumulate(costs, initial=0))
    best_max = _min_max_stage_cost(prefix, num_stages)
    limit = math.floor(best_max * (1 + tolerance + _RELATIVE_EPSILON))
    starts = _cheapest_split(prefix, cuts, num_stages, limit)
    return StagePartition(starts=starts, num_clusters=len(costs))


def _min_max_stage_cost(prefix: list[int], num_stages: int) -> int:
    """Smallest achievable cost of the slowest stage over all contiguous ``num_stages``-splits.

    ``best[j]`` is that value for the first ``j`` clusters split into the current number of stages.
    It never decreases with ``j`` (costs are >= 0) while the last stage's cost ``prefix[j] -
    prefix[i]`` never increases with its start ``i``, so the best start is where the two cross,
    found by bisection on ``best[i] + prefix[i]``.
    """
    n = len(prefix) - 1
    best = prefix[:]
    for stages in range(2, num_stages + 1):
        key = [b + p for b, p in zip(best, prefix)]
        new = [0] * (n + 1)
        for j in range(stages, n - (num_stages - stages) + 1):
            lo, hi = stages - 1, j - 1
            cross = bisect_left(key, prefix[j], lo, hi + 1)
            options = []
            if cross <= hi:
                options.append(best[cross])
            if cross > lo:
                options.append(prefix[j] - prefix[cross - 1])
            new[j] = min(options)
        best = new
    return best[n]


def _cheapest_split(prefix: list[int], cuts: list[int], num_stages: int, limit: int) -> tuple[int, ...]:
    """Starts of the split with stages costing ``<= limit``: fewest cut bytes, then smallest max
    stage cost, then lexicographically smallest starts.

    ``cut_bytes_of[s][i]`` / ``max_cost_of[s][i]`` describe the best split of clusters ``[i, n)``
    into ``s`` stages (bytes ``inf`` when none fits the limit). The (bytes, max) order is preserved
    when a stage is prepended, so suffix optima compose; the starts are then read forwards, taking
    at each step the earliest cut that still reaches the overall optimum.
    """
    n = len(prefix) - 1
    inf = math.inf
    last = [0 if prefix[n] - prefix[i] <= limit else inf for i in range(n + 1)]
    cut_bytes_of: list[list] = [[], last]
    max_cost_of: list[list[int]] = [[], [prefix[n] - prefix[i] for i in range(n + 1)]]
    for stages in range(2, num_stages + 1):
        later_bytes, later_max = cut_bytes_of[-1], max_cost_of[-1]
        via = [inf] + [cuts[j - 1] + later_bytes[j] for j in range(1, n)] + [inf]
        here_bytes: list = [inf] * (n + 1)
        here_max = [0] * (n + 1)
        for i in range(num_stages - stages, n - stages + 1):
            last_end = min(bisect_right(prefix, prefix[i] + limit) - 1, n - stages + 1)
            if last_end <= i:
                continue
            fewest = min(via[i + 1 : last_end + 1])
            if fewest == inf:
                continue
            here_bytes[i] = fewest
            ties = (j for j in range(i + 1, last_end + 1) if via[j] == fewest)
            here_max[i] = min(max(prefix[j] - prefix[i], later_max[j]) for j in ties)
        cut_bytes_of.append(here_bytes)
        max_cost_of.append(here_max)

    target = (cut_bytes_of[num_stages][0], max_cost_of[num_stages][0])
    starts, start, spent, worst = [0], 0, 0, 0
    for stages in range(num_stages, 1, -1):
        for end in range(start + 1, n - stages + 2):
            cost = prefix[end] - prefix[start]
            if cost > limit:
                break
            rest_bytes, rest_max = cut_bytes_of[stages - 1][end], max_cost_of[stages - 1][end]
            if (spent + cuts[end - 1] + rest_bytes, max(worst, cost, rest_max)) == target:
                break
        else:  # pragma: no cover - the optimum is always reachable
            raise AssertionError("no split reaches the optimum found by the search")
        spent, worst = spent + cuts[end - 1], max(worst, cost)
        starts.append(end)
        start = end
    return tuple(starts)


def _scaled_integers(costs: list[float]) -> list[int]:
    """The costs times one common power of two, as exact integers (same order, same sums)."""
    exact = [Fraction(int(c)) if isinstance(c, numbers.Integral) else Fraction(float(c)) for c in costs]
    scale = math.lcm(*(f.denominator for f in exact))
    return [f.numerator * (scale // f.denominator) for f in exact]


# --- validation -----------------------------------------------------------------------------------


def _whole(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must hold whole numbers, got {value!r}.")
    return int(value)


def _check_starts(starts: tuple[int, ...], num_clusters: int) -> None:
    if not starts or starts[0] != 0:
        raise ValueError(f"starts={list(starts)} must begin with 0 (the first stage starts at cluster 0).")
    for prev, cur in zip(starts, starts[1:]):
        if cur <= prev:
            raise ValueError(
                f"starts={list(starts)} must strictly increase (no stage may be empty); {cur} follows {prev}."
            )
    if starts[-1] >= num_clusters:
        raise ValueError(
            f"starts={list(starts)} has a stage starting at cluster {starts[-1]}, but there are only "
            f"{num_clusters} clusters; every start must be < num_clusters={num_clusters}."
        )


def _check_num_stages(num_stages: object) -> int:
    if isinstance(num_stages, bool) or not isinstance(num_stages, numbers.Integral) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r} is invalid; use a whole number of stages >= 1.")
    return int(num_stages)


def _check_stage_count(num_stages: int, num_clusters: int, name: str) -> None:
    if num_clusters == 0:
        raise ValueError(f"{name} is empty; the model must split into at least 1 cluster to be partitioned.")
    if num_stages > num_clusters:
        raise ValueError(
            f"num_stages={num_stages} exceeds the {num_clusters} clusters the model splits into; "
            f"use at most {num_clusters} stages."
        )


def _check_costs(name: str, values: Sequence[float]) -> list[float]:
    values = list(values)
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name}[{index}]={value!r} is not a number; costs must be finite and >= 0.")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name}[{index}]={value!r} is invalid; costs must be finite and >= 0.")
    return values


def _check_length(name: str, values: Sequence, expected: int, meaning: str) -> None:
    if len(values) != expected:
        raise ValueError(f"{name} has {len(values)} entries; expected {expected} ({meaning}).")


def _check_cut_bytes(cut_bytes: Sequence[int], num_clusters: int) -> list[int]:
    cuts = list(cut_bytes)
    _check_length("cut_bytes", cuts, num_clusters - 1, "one per cut between consecutive clusters")
    for index, value in enumerate(cuts):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"cut_bytes[{index}]={value!r} is invalid; byte counts are whole numbers >= 0.")
    return [int(value) for value in cuts]


def _check_tolerance(tolerance: float) -> Fraction:
    if (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, numbers.Real)
        or not math.isfinite(tolerance)
        or tolerance < 0
    ):
        raise ValueError(f"tolerance={tolerance!r} is invalid; use a finite fraction >= 0 (0.02 = 2%).")
    return Fraction(tolerance) if isinstance(tolerance, numbers.Rational) else Fraction(float(tolerance))
