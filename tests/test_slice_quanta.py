"""Measured slice weights are cut in whole quanta of 1/64 of a bucket.

Equal GPUs report free memory a few MB apart; slices cut exactly to such weights differ by as little, and
the reducer can then use neither its flat reduce-scatter nor its flat all-gather (both need equal slices).
"""

from __future__ import annotations

import pytest

from lightning_hier.sliced.reducer import _is_equal
from lightning_hier.sliced.slicing import SLICE_QUANTA, combine_measurements, quantise_weights

# free memory of four equal 80 GB GPUs, a few MB apart, and weights within 0.001 of each other
NEAR_EQUAL = [[1.0, 0.999, 1.001, 1.0], [79.105e9, 79.098e9, 79.113e9, 79.101e9]]


def _check_cover(bounds: tuple[tuple[int, int], ...], numel: int) -> list[int]:
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    for (_, end), (start, _) in zip(bounds, bounds[1:]):
        assert end == start
    sizes = [end - start for start, end in bounds]
    assert all(size >= 0 for size in sizes)
    return sizes


@pytest.mark.parametrize("measured", NEAR_EQUAL)
@pytest.mark.parametrize("numel", [1000, 4097, 12345, 37, 3])
def test_devices_within_a_quantum_get_equal_slices_and_the_flat_collectives(
    measured: list[float], numel: int
) -> None:
    plan = combine_measurements(measured, devices_per_node=4)
    padded = plan.padded_numel(numel)
    assert padded == -(-numel // 4) * 4  # padded like an equal plan
    bounds = plan.bounds(padded)
    assert _is_equal(bounds), bounds
    assert _check_cover(bounds, padded) == [padded // 4] * 4


@pytest.mark.parametrize(
    ("measured", "quanta"),
    [([2.0, 1.0, 1.0], [32, 16, 16]), ([3.0, 2.0, 2.0], [28, 18, 18]), ([4.0, 2.0], [43, 21])],
)
@pytest.mark.parametrize("numel", [64 * 1000, 1000, 12345, 63, 37, 5, 1, 0])
def test_unequal_devices_get_whole_quanta_proportional_within_one(
    measured: list[float], quanta: list[int], numel: int
) -> None:
    plan = combine_measurements(measured, devices_per_node=len(measured))
    assert plan.padded_numel(numel) == numel
    bounds = plan.bounds(numel)
    sizes = _check_cover(bounds, numel)
    total = sum(measured)
    quantum = numel / SLICE_QUANTA
    for size, weight in zip(sizes, measured):
        assert abs(size - numel * weight / total) <= quantum + 1  # one quantum, and an element of rounding
    # every edge is a whole number of quanta (rounded to an element): 3:2:2 is 27.4 : 18.3 : 18.3 quanta
    edges = [end for _, end in bounds]
    cumulative = [sum(quanta[: k + 1]) for k in range(len(quanta))]
    assert edges == [round(q * numel / SLICE_QUANTA) for q in cumulative]
    if numel == 64 * 1000:
        assert sizes == [q * 1000 for q in quanta]


def test_quanta_sum_to_the_bucket_and_follow_the_weights() -> None:
    assert quantise_weights([1.0, 0.999, 1.001, 1.0]) == (1.0,) * 4
    assert quantise_weights([1.0, 1.0, 1.0]) == (1.0,) * 3  # 64 does not divide by 3: an equal plan
    assert quantise_weights([2.0, 1.0, 1.0]) == (32.0, 16.0, 16.0)
    # near-equal devices beside a weaker one: 25.6, 25.6 and 12.8 quanta, the pair kept equal
    assert quantise_weights([1.0, 1.0001, 0.5]) == (26.0, 26.0, 12.0)
    # a device far below a quantum still gets one
    assert quantise_weights([1.0, 1000.0]) == (1.0, 63.0)
    # more devices than 64 quanta: 128, each device within one of its share
    weights = [1.0] * 65 + [2.0]
    many = quantise_weights(weights)
    assert sum(many) == 128 and all(abs(q - w * 128 / 67) < 1 for q, w in zip(many, weights))
