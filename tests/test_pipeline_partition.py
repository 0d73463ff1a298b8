"""Pipeline stage partitions: exactness against brute force, hand cases, helpers and validation."""

from __future__ import annotations

import itertools
import json
import random
from fractions import Fraction

import pytest

from lightning_hier.pipeline.partition import (
    StagePartition,
    boundary_bytes,
    imbalance,
    partition_balanced,
    partition_uniform,
    stage_costs,
)


def brute_force_starts(costs, num_stages, cut_bytes, tolerance):
    """Reference: enumerate every split and apply the criterion with exact rational arithmetic."""
    n = len(costs)
    exact = [Fraction(c) for c in costs]
    cuts = cut_bytes if cut_bytes is not None else [0] * (n - 1)
    splits = [(0, *c) for c in itertools.combinations(range(1, n), num_stages - 1)]

    def max_cost(starts):
        ends = (*starts[1:], n)
        return max(sum(exact[a:b], Fraction(0)) for a, b in zip(starts, ends))

    best = min(max_cost(s) for s in splits)
    limit = best * (1 + Fraction(tolerance)) + Fraction(1e-12) * best
    acceptable = [s for s in splits if max_cost(s) <= limit]
    return min(acceptable, key=lambda s: (sum(cuts[c - 1] for c in s[1:]), max_cost(s), s))


def random_case(rng, kind, max_clusters):
    n = rng.randint(1, max_clusters)
    if kind == "float":
        costs = [0.0 if rng.random() < 0.1 else rng.uniform(0, 10) for _ in range(n)]
    elif kind == "decimal":  # 0.1-style floats whose sums round differently in different orders
        costs = [rng.choice([0.1, 0.2, 0.3, 0.7]) for _ in range(n)]
    else:  # small integers: many ties between splits
        costs = [rng.randint(0, 3) for _ in range(n)]
    cut_bytes = None if rng.random() < 0.2 else [rng.choice([0, 1, 2, 4, 8, 64]) for _ in range(n - 1)]
    return costs, rng.randint(1, n), cut_bytes


@pytest.mark.parametrize("tolerance", [0.0, 0.02, 0.2])
@pytest.mark.parametrize("kind", ["float", "int", "decimal"])
def test_matches_brute_force_on_random_small_cases(kind, tolerance):
    rng = random.Random(f"{kind}-{tolerance}")
    for _ in range(300):
        costs, num_stages, cut_bytes = random_case(rng, kind, max_clusters=9)
        got = partition_balanced(costs, num_stages, cut_bytes, tolerance)
        want = brute_force_starts(costs, num_stages, cut_bytes, tolerance)
        assert got.starts == want, (costs, num_stages, cut_bytes, tolerance)
        assert got.num_stages == num_stages and got.num_clusters == len(costs)


@pytest.mark.parametrize("kind", ["float", "int"])
def test_matches_brute_force_on_medium_cases(kind):
    rng = random.Random(f"medium-{kind}")
    for _ in range(25):
        costs, _, cut_bytes = random_case(rng, kind, max_clusters=14)
        num_stages = rng.randint(1, min(4, len(costs)))
        tolerance = rng.choice([0.0, 0.05, 0.3])
        got = partition_balanced(costs, num_stages, cut_bytes, tolerance)
        assert got.starts == brute_force_starts(costs, num_stages, cut_bytes, tolerance)


def test_equal_costs_split_in_half():
    assert partition_balanced([1, 1, 1, 1], 2).starts == (0, 2)
    assert partition_balanced([1, 1, 1, 1], 4).starts == (0, 1, 2, 3)
    assert partition_balanced([1, 1, 1, 1], 1).starts == (0,)


def test_tolerance_trades_balance_for_fewer_boundary_bytes():
    # Splits of [5, 1, 4, 5] in two: (0,1) -> 5|10, (0,2) -> 6|9, (0,3) -> 10|5. M* = 9.
    costs, cut_bytes = [5, 1, 4, 5], [1000, 1000, 10]
    assert partition_balanced(costs, 2, cut_bytes, tolerance=0.0).starts == (0, 2)
    assert partition_balanced(costs, 2, cut_bytes, tolerance=0.1).starts == (0, 2)  # limit 9.9 < 10
    assert partition_balanced(costs, 2, cut_bytes, tolerance=0.2).starts == (0, 3)  # limit 10.8: 10 bytes
    # Equal bytes: the smaller max stage cost wins; then the lexicographically smaller starts.
    assert partition_balanced(costs, 2, [7, 7, 7], tolerance=0.2).starts == (0, 2)
    assert partition_balanced(costs, 2, [10, 1000, 10], tolerance=0.2).starts == (0, 1)


def test_no_stage_is_ever_empty():
    rng = random.Random("nonempty")
    for _ in range(200):
        n = rng.randint(1, 30)
        costs = [rng.choice([0, 0, 1, 100]) for _ in range(n)]  # zero-cost clusters invite empty stages
        num_stages = rng.randint(1, n)
        partition = partition_balanced(costs, num_stages, tolerance=rng.choice([0.0, 1.0]))
        ranges = partition.stage_ranges()
        assert len(ranges) == num_stages
        assert all(end > start for start, end in ranges)
        assert ranges[0][0] == 0 and ranges[-1][1] == n


def test_larger_model_is_balanced_within_tolerance():
    rng = random.Random("large")
    costs = [rng.uniform(0.5, 2.0) for _ in range(300)]
    cut_bytes = [rng.randint(1, 1 << 20) for _ in range(299)]
    exact = partition_balanced(costs, 8, tolerance=0.0)
    cheap = partition_balanced(costs, 8, cut_bytes, tolerance=0.05)
    best = max(stage_costs(exact, costs))
    assert max(stage_costs(cheap, costs)) <= best * 1.05 + 1e-9
    assert boundary_bytes(cheap, cut_bytes) <= boundary_bytes(exact, cut_bytes)


def test_partition_uniform_counts_layers():
    partition = partition_uniform([1] * 16, 4)
    assert partition.starts == (0, 4, 8, 12)
    assert stage_costs(partition, [1] * 16) == [4, 4, 4, 4]
    assert partition_uniform([2, 1, 1, 2, 1, 1], 2).starts == (0, 3)
    with pytest.raises(ValueError, match=r"num_items_per_cluster\[1\]=1.5"):
        partition_uniform([1, 1.5], 1)


def test_stage_costs_boundary_bytes_and_imbalance():
    partition = StagePartition(starts=(0, 3, 7), num_clusters=9)
    costs = [1, 2, 3, 1, 1, 1, 1, 0.5, 0.25]
    assert stage_costs(partition, costs) == [6, 4, 0.75]
    assert boundary_bytes(partition, [1, 2, 30, 4, 5, 6, 700, 8]) == 730
    assert boundary_bytes(StagePartition((0,), 3), [5, 5]) == 0
    assert imbalance([1.0, 2.0, 3.0]) == pytest.approx(1.0)
    assert imbalance([4.0, 4.0]) == 0.0
    assert imbalance([7.0]) == 0.0
    assert imbalance([0.0, 0.0, 0.0]) == 0.0
    with pytest.raises(ValueError, match="cluster_costs has 2 entries; expected 9"):
        stage_costs(partition, [1, 2])
    with pytest.raises(ValueError, match="cut_bytes has 2 entries; expected 8"):
        boundary_bytes(partition, [1, 2])
    with pytest.raises(ValueError, match="stage_times is empty"):
        imbalance([])


def test_partition_accessors_and_str():
    partition = StagePartition(starts=(0, 3, 7), num_clusters=9)
    assert partition.num_stages == 3
    assert partition.stage_ranges() == [(0, 3), (3, 7), (7, 9)]
    assert [partition.stage_of_cluster(c) for c in range(9)] == [0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert str(partition) == "clusters [0,3) | [3,7) | [7,9)"
    with pytest.raises(ValueError, match="cluster=9"):
        partition.stage_of_cluster(9)


def test_dict_round_trip():
    partition = StagePartition(starts=(0, 2, 5), num_clusters=6)
    data = json.loads(json.dumps(partition.to_dict()))
    assert data == {"starts": [0, 2, 5], "num_clusters": 6}
    restored = StagePartition.from_dict(data)
    assert restored == partition and isinstance(restored.starts, tuple)
    with pytest.raises(ValueError, match="num_clusters"):
        StagePartition.from_dict({"starts": [0]})


@pytest.mark.parametrize(
    ("starts", "num_clusters", "message"),
    [
        ((), 3, "must begin with 0"),
        ((1, 2), 3, "must begin with 0"),
        ((0, 2, 2), 3, "strictly increase"),
        ((0, 3, 1), 4, "strictly increase"),
        ((0, 3), 3, "only 3 clusters"),
        ((0,), 0, "num_clusters=0"),
        ((0, 1.5), 3, "whole numbers"),
    ],
)
def test_stage_partition_validation(starts, num_clusters, message):
    with pytest.raises(ValueError, match=message):
        StagePartition(starts=starts, num_clusters=num_clusters)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"num_stages": 5},
            "num_stages=5 exceeds the 3 clusters the model splits into; use at most 3 stages",
        ),
        ({"num_stages": 0}, "num_stages=0"),
        ({"num_stages": 2.0}, "num_stages=2.0"),
        ({"cluster_costs": [1, -1, 1]}, r"cluster_costs\[1\]=-1"),
        ({"cluster_costs": [1, float("nan"), 1]}, r"cluster_costs\[1\]=nan"),
        ({"cluster_costs": [1, 1, float("inf")]}, r"cluster_costs\[2\]=inf"),
        ({"cluster_costs": []}, "cluster_costs is empty"),
        ({"cut_bytes": [1]}, "cut_bytes has 1 entries; expected 2"),
        ({"cut_bytes": [1, -4]}, r"cut_bytes\[1\]=-4"),
        ({"tolerance": -0.1}, "tolerance=-0.1"),
        ({"tolerance": float("nan")}, "tolerance=nan"),
    ],
)
def test_partition_balanced_validation(kwargs, message):
    args = {"cluster_costs": [1, 2, 3], "num_stages": 2, "cut_bytes": None, "tolerance": 0.02, **kwargs}
    with pytest.raises(ValueError, match=message):
        partition_balanced(**args)
