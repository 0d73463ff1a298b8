"""Unit tests for the slice planner, the size bucket planner and Topology validation."""

from __future__ import annotations

import pytest

from lightning_hier.bucketing.size_plan import BucketPlan, ParamInfo, plan_size_buckets
from lightning_hier.sliced.slicing import SlicePlan, combine_measurements, validate_slice_weights
from lightning_hier.topology import Topology


def test_equal_plan_pads_to_multiple_and_splits_evenly() -> None:
    plan = SlicePlan((1.0, 1.0, 1.0, 1.0))
    assert plan.padded_numel(10) == 12
    assert plan.bounds(12) == ((0, 3), (3, 6), (6, 9), (9, 12))


def test_weighted_plan_follows_weights() -> None:
    plan = SlicePlan((3.0, 1.0))
    assert plan.padded_numel(10) == 10
    assert plan.bounds(100) == ((0, 75), (75, 100))
    assert plan.bounds(10) == ((0, 8), (8, 10))  # round(7.5) == 8: within one element of the share


@pytest.mark.parametrize("numel", [0, 1, 2, 7, 1000, 12345])
@pytest.mark.parametrize("weights", [(1, 1), (3, 1), (5, 1, 1, 2), (1, 1000)])
def test_bounds_cover_range_contiguously(numel: int, weights: tuple) -> None:
    bounds = SlicePlan(tuple(float(w) for w in weights)).bounds(numel)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    for (_, end), (start, _) in zip(bounds, bounds[1:]):
        assert end == start
    total = sum(weights)
    for (start, end), weight in zip(bounds, weights):
        assert abs((end - start) - numel * weight / total) <= 1.0


def test_combine_measurements_takes_weakest_device_per_local_index() -> None:
    # 2 nodes x 2 devices: rank r has local index r % 2
    plan = combine_measurements([8.0, 2.0, 4.0, 6.0], devices_per_node=2)
    # 4 : 2 in whole 64ths of a bucket (42.7 and 21.3, the largest remainder rounded up)
    assert plan.weights == (43 / 64, 21 / 64)


@pytest.mark.parametrize(
    ("weights", "message"),
    [("fast", "not a known mode"), ([1, 0], "positive"), ([1, -2], "positive"), ([1, 2, 3], "exactly 2")],
)
def test_bad_slice_weights_name_the_setting(weights: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_slice_weights(weights, devices_per_node=2)


def test_topology_layout() -> None:
    topo = Topology(world_size=4, rank=3, devices_per_node=2)
    assert (topo.num_nodes, topo.node_rank, topo.local_rank) == (2, 1, 1)
    assert topo.intra_ranks() == [2, 3]
    assert topo.inter_ranks() == [1, 3]
    assert Topology.from_world(8, 5, None, processes_per_host=4).devices_per_node == 4


@pytest.mark.parametrize(
    ("world", "per_node", "message"), [(4, 3, r"valid values are \[1, 2, 4\]"), (4, 0, "positive")]
)
def test_topology_rejects_bad_layouts(world: int, per_node: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Topology(world_size=world, rank=0, devices_per_node=per_node)


def test_size_buckets_respect_cap_group_and_reverse_order() -> None:
    params = [ParamInfo(i, numel=10, element_size=4, group_key=("g", 0 if i < 4 else 1)) for i in range(6)]
    plan = plan_size_buckets(params, cap_bytes=80)
    assert plan.buckets == ((5, 4), (3, 2), (1, 0))
    assert plan.bucket_of()[2] == 1
    big = plan_size_buckets([ParamInfo(0, 1000, 4, "g"), ParamInfo(1, 1, 4, "g")], cap_bytes=16)
    assert big.buckets == ((1,), (0,))


def test_bucket_plan_rejects_duplicates() -> None:
    with pytest.raises(ValueError, match="more than one bucket"):
        BucketPlan(((0, 1), (1, 2)))
