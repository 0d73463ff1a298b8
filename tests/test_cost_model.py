"""The communication cost model against hand-computed alpha-beta cases, and its command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightning_hier.plan import Cluster, plan
from lightning_hier.plan.cli import duration, rate
from lightning_hier.plan.cost_model import (
    bandwidth_bound,
    bsp_superstep,
    flat_ring,
    hierarchical,
    with_overlap,
)

MB = 1e6


def test_flat_ring_two_nodes_of_two_by_hand() -> None:
    # p = 4: 2(p-1) = 6 steps, each endpoint sends 6/4 * S; the node's link carries 1.5 S at 25 MB/s
    cluster = Cluster(
        nodes=2, devices_per_node=2, intra_bandwidth=1000 * MB, inter_bandwidth=25 * MB, latency=1e-3
    )
    e = flat_ring(cluster, 100 * MB)
    assert e.inter_bytes_per_node == pytest.approx(150 * MB)
    assert e.seconds == pytest.approx(6 * 1e-3 + 150 * MB / (25 * MB))  # 6.006 s


def test_hierarchical_two_by_two_by_hand() -> None:
    cluster = Cluster(
        nodes=2, devices_per_node=2, intra_bandwidth=1000 * MB, inter_bandwidth=25 * MB, latency=1e-3
    )
    e = hierarchical(cluster, 100 * MB)
    # reduce-scatter and all-gather in the node: 1 step each of a 50 MB slice at 1000 MB/s
    # all-reduce across 2 nodes: 2 steps, 2(N-1)/N * S = 100 MB over the node's 25 MB/s link
    assert e.seconds == pytest.approx(2 * (1e-3 + 0.05) + 2 * 1e-3 + 100 * MB / (25 * MB))  # 4.104 s
    assert e.inter_bytes_per_node == pytest.approx(100 * MB)
    assert e.intra_bytes_per_device == pytest.approx(2 * 50 * MB)
    # the bytes bound of the README's benchmark: hier / flat = 1.0 / 1.5
    assert e.inter_bytes_per_node / flat_ring(cluster, 100 * MB).inter_bytes_per_node == pytest.approx(2 / 3)
    assert bandwidth_bound(cluster, 100 * MB).seconds == pytest.approx(4.0)


def test_weighted_slices_slow_the_intra_steps_not_the_link() -> None:
    cluster = Cluster(
        nodes=2, devices_per_node=2, intra_bandwidth=100 * MB, inter_bandwidth=25 * MB, latency=0
    )
    equal, weighted = hierarchical(cluster, 100 * MB), hierarchical(cluster, 100 * MB, [3, 1])
    # the 75 MB slice: 0.75 s instead of 0.5 s, twice (reduce-scatter and all-gather)
    assert weighted.seconds - equal.seconds == pytest.approx(2 * 0.25)
    assert weighted.inter_bytes_per_node == equal.inter_bytes_per_node


def test_overlap_and_bsp_by_hand() -> None:
    cluster = Cluster(nodes=4, devices_per_node=1, intra_bandwidth=1e9, inter_bandwidth=10 * MB, latency=0)
    e = hierarchical(cluster, 40 * MB)  # 2 * 3/4 * 40 MB = 60 MB over 10 MB/s = 6 s
    assert e.seconds == pytest.approx(6.0)
    assert with_overlap(e, backward_seconds=4.0, buckets=10, name="x").exposed_seconds == pytest.approx(2.0)
    assert with_overlap(e, backward_seconds=9.0, buckets=10, name="x").exposed_seconds == pytest.approx(0.6)
    bsp = bsp_superstep(cluster, 40 * MB, superstep_steps=4, step_seconds=1.0)
    assert bsp.exposed_seconds == pytest.approx((6.0 - 4.0) / 4)


def test_plan_and_dtype() -> None:
    cluster = Cluster(nodes=2, devices_per_node=8, intra_bandwidth=300e9, inter_bandwidth=50e9, latency=5e-6)
    result = plan(cluster, params=1e9, dtype="bf16", backward_seconds=0.2)
    assert result.gradient_bytes == 2e9
    names = [e.name for e in result.estimates]
    assert names[0].startswith("ddp") and "hier_sliced" in names and names[-1] == "bandwidth bound"
    assert result.by_name("hier_sliced").inter_bytes_per_node == pytest.approx(2e9)  # 2(N-1)/N * S, N = 2
    with pytest.raises(ValueError, match="dtype="):
        plan(cluster, params=1e9, dtype="int3")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(nodes=0, devices_per_node=2, intra_bandwidth=1, inter_bandwidth=1), "nodes must be a positive"),
        (dict(nodes=2, devices_per_node=2, intra_bandwidth=-1, inter_bandwidth=1), "intra_bandwidth must be"),
        (dict(nodes=2, devices_per_node=2, intra_bandwidth=1, inter_bandwidth=1, latency=-1), "latency"),
    ],
)
def test_bad_clusters_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Cluster(**kwargs)


def test_units() -> None:
    assert rate("400Gbit/s") == pytest.approx(50e9)
    assert rate("400Gbit") == pytest.approx(50e9)
    assert rate("50GB/s") == pytest.approx(50e9)
    assert rate("2e9") == 2e9
    assert duration("5us") == pytest.approx(5e-6) and duration("2ms") == pytest.approx(2e-3)
    assert duration("7") == pytest.approx(7e-6)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lightning_hier", "plan", *args], capture_output=True, text=True
    )


def test_cli_prints_a_table_and_refuses_bad_input() -> None:
    ok = _cli("--nodes", "2", "--devices-per-node", "2", "--intra-bandwidth", "2GB/s", "--inter-bandwidth",
              "200Mbit", "--params", "6.3e6", "--backward", "100ms")  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    rows = {line.split("  ")[0]: line for line in ok.stdout.splitlines()}
    assert "hier_sliced" in rows and "bandwidth bound" in rows
    assert rows["hier_sliced"].split()[-1] == "0.67"  # vs ddp: the 2x2 bytes ratio
    bad = _cli("--world-size", "6", "--devices-per-node", "4", "--intra-bandwidth", "1GB/s",
               "--inter-bandwidth", "1GB/s", "--params", "10")  # fmt: skip
    assert bad.returncode == 2 and "does not divide world_size=6" in bad.stderr
    negative = _cli("--nodes", "2", "--devices-per-node", "2", "--intra-bandwidth", "1GB/s",
                    "--inter-bandwidth", "1GB/s", "--params", "-1")  # fmt: skip
    assert negative.returncode == 2 and "params must be positive" in negative.stderr
