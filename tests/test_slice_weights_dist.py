"""Measured slice weights: one plan, decided on rank 0 from every rank's measurement, on all ranks."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import init_gloo, run_spawned

from lightning_hier.sliced import slicing


def _decide(rank: int, world: int, store: str, mode: str) -> dict:
    init_gloo(rank, world, store)
    free = [8e9, 2e9, 4e9, 6e9][rank]  # pretend each rank sees different free memory
    slicing.measure_free_memory = lambda device, processes: free
    speed = [1.0, 4.0, 1.0, 1.0][rank]  # and different matmul throughput
    slicing.measure_matmul_throughput = lambda device: speed
    plan = slicing.decide_slice_plan(
        mode, devices_per_node=2, device=torch.device("cpu"), processes_per_host=2
    )
    return {"weights": plan.weights}


def test_memory_weights_take_the_weakest_device_of_each_local_index(tmp_path: Path) -> None:
    results = run_spawned(_decide, 4, tmp_path, "memory")
    for result in results:
        # min(8, 4) : min(2, 6) = 4 : 2, in whole 64ths of a bucket (42.7 and 21.3 rounded)
        assert result["weights"] == (43 / 64, 21 / 64)


def test_memory_and_compute_weights_multiply_memory_by_speed(tmp_path: Path) -> None:
    results = run_spawned(_decide, 4, tmp_path, "memory+compute")
    # memory x speed per rank: 8, 8, 4, 6 -> local index 0: min(8, 4), local index 1: min(8, 6)
    # in whole 64ths of a bucket: 25.6 and 38.4 rounded
    for result in results:
        assert result["weights"] == (26 / 64, 38 / 64)


def test_matmul_probe_measures_a_positive_rate() -> None:
    rate = slicing.measure_matmul_throughput(torch.device("cpu"), size=64, repeats=2)
    assert 0 < rate < float("inf")
