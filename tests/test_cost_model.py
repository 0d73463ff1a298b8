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
    hop_ratio,
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


def test_compressed_hops_carry_their_share_of_the_bytes_by_hand() -> None:
    """2 nodes x 2 devices, 400 MB of fp32 gradients: the int8 hop carries 1 byte plus a 4-byte scale per
    2048 elements of each 4, the bf16 hop 2 of 4; the intra-node steps are unchanged."""
    cluster = Cluster(nodes=2, devices_per_node=2, intra_bandwidth=1e9, inter_bandwidth=1e8, latency=0.0)
    result = plan(cluster, params=100e6, dtype="fp32", inter_node_dtype="int8")
    int8, full = result.by_name("hier_sliced, int8 hop"), result.by_name("hier_sliced")
    share = (1 + 4 / 2048) / 4
    assert int8.inter_bytes_per_node == pytest.approx(400 * MB * share)  # ring of 2: (2 - 1) / 2 x 2 x S
    intra_seconds = 2 * (200 * MB / 1e9)  # reduce-scatter and all-gather of half the gradients each
    assert int8.seconds == pytest.approx(intra_seconds + 400 * MB * share / 1e8)
    assert full.seconds == pytest.approx(intra_seconds + 400 * MB / 1e8)
    bf16 = plan(cluster, params=100e6, dtype="fp32", inter_node_dtype="bfloat16")
    assert bf16.by_name("hier_sliced, bfloat16 hop").inter_bytes_per_node == pytest.approx(200 * MB)
    same = plan(cluster, params=100e6, dtype="bf16", inter_node_dtype="bfloat16")  # nothing to compress
    assert same.by_name("hier_sliced, bfloat16 hop").seconds == pytest.approx(
        same.by_name("hier_sliced").seconds
    )
    fp8 = plan(cluster, params=100e6, dtype="fp32", inter_node_dtype="fp8")  # int8's blocks of e4m3 values
    assert fp8.by_name("hier_sliced, fp8 hop").inter_bytes_per_node == pytest.approx(400 * MB * share)
    with pytest.raises(ValueError, match="inter_node_dtype='fp4' is not one of"):
        plan(cluster, params=1e6, inter_node_dtype="fp4")


def test_pipeline_stages_by_replicas_by_hand() -> None:
    """2 nodes x 2 devices, 400 bytes of gradients, 4 micro-batches of 8-byte boundary activations, 1 s of
    compute per step, no latency. Two stages x two replicas: each node's link carries the rings of both
    stages (200 bytes each way, 40 s at 10 B/s), the boundary stays inside the node (0.08 s per send).
    Four stages x one replica: no all-reduce, the boundary between the nodes bounds the step."""
    from lightning_hier.plan import pipeline_estimate

    cluster = Cluster(nodes=2, devices_per_node=2, intra_bandwidth=100.0, inter_bandwidth=10.0, latency=0.0)
    two = pipeline_estimate(cluster, 400.0, stages=2, micro_batches=4, activation_bytes=8.0, step_seconds=1.0)
    assert two.inter_bytes_per_node == pytest.approx(400.0)
    assert two.intra_bytes_per_device == pytest.approx(200.0 + 2 * 4 * 8.0)
    assert two.seconds == pytest.approx(40.0 + 2 * 4 * 0.08)
    bubble, fill_and_drain, hidden = 0.25, 2 * 0.08, 2 / 3 * 0.25  # last micro-batch's backward hides some
    assert two.exposed_seconds == pytest.approx(bubble + fill_and_drain + 40.0 - hidden)
    four = pipeline_estimate(
        cluster, 400.0, stages=4, micro_batches=4, activation_bytes=8.0, step_seconds=1.0
    )
    sends = [0.08, 0.8, 0.08]  # ranks 1 -> 2 cross the nodes' link
    assert four.seconds == pytest.approx(2 * 4 * sum(sends))
    link_bound = 4 * (2 * 0.8 - 0.25)  # a micro-batch's two sends take longer than its compute
    assert four.exposed_seconds == pytest.approx(0.75 + 2 * sum(sends) + link_bound)
    assert four.inter_bytes_per_node == pytest.approx(4 * 8.0)
    with pytest.raises(
        ValueError, match=r"stages=3 does not divide the world size 4; choose one of \[1, 2, 4\]"
    ):
        pipeline_estimate(cluster, 400.0, stages=3, micro_batches=4, activation_bytes=8.0, step_seconds=1.0)


def test_cli_prices_pipelines_and_hops_and_names_what_is_missing() -> None:
    base = ("--nodes", "2", "--devices-per-node", "8", "--intra-bandwidth", "300GB/s", "--inter-bandwidth",
            "200Gbit", "--params", "7e9", "--dtype", "bf16", "--backward", "300ms")  # fmt: skip
    ok = _cli(*base, "--inter-node-dtype", "int8", "--pipeline-stages", "2", "16", "--activation-mb", "64")
    assert ok.returncode == 0, ok.stderr
    rows = {line.split("  ")[0] for line in ok.stdout.splitlines()}
    assert {"hier_sliced, int8 hop", "hier_pipeline (stages=2)", "hier_pipeline (stages=16)"} <= rows
    missing = _cli(*base, "--pipeline-stages", "2")
    assert missing.returncode == 2 and "--activation-mb" in missing.stderr
    odd = _cli(*base, "--pipeline-stages", "3", "--activation-mb", "1")
    assert odd.returncode == 2 and "stages=3 does not divide the world size 16" in odd.stderr


def test_a_compressed_bsp_push_exposes_less_per_micro_step_by_hand() -> None:
    """2 nodes x 1 device, 400 MB of fp32 gradients over 100 MB/s: the full push takes 4 s per superstep of 2
    micro-steps of 1 s (1 s exposed per micro-step); an int8 push carries a quarter plus the scales, 1.00 s,
    all of it hidden behind the 2 s of compute."""
    cluster = Cluster(nodes=2, devices_per_node=1, intra_bandwidth=1e9, inter_bandwidth=100 * MB, latency=0.0)
    result = plan(
        cluster, params=100e6, dtype="fp32", superstep_steps=2, step_seconds=1.0, inter_node_dtype="int8"
    )
    full, int8 = (
        result.by_name("hier_bsp (superstep_steps=2)"),
        result.by_name("hier_bsp (superstep_steps=2, int8 push)"),
    )
    assert full.seconds == pytest.approx(4.0) and full.exposed_seconds == pytest.approx(1.0)
    share = hop_ratio("fp32", "int8")
    assert int8.inter_bytes_per_node == pytest.approx(full.inter_bytes_per_node * share)
    assert int8.seconds == pytest.approx(4.0 * share) and int8.exposed_seconds == 0.0
