"""A node's ranks must share a host: checked from the host names every rank reports once the group exists.

Unchecked, ``devices_per_node`` larger than a host's processes, or ranks numbered round-robin over the
hosts (SLURM ``--distribution=cyclic``), would silently make the "fast" in-node groups cross the network,
and HybridEmbedding's node tables (shared memory, one host's) would fail to map on the other host's ranks
with a bare ``FileNotFoundError`` while the rest waited.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_torchrun

from lightning_hier import Topology
from lightning_hier.topology import nodes_across_hosts, nodes_across_hosts_problem


@pytest.mark.parametrize(
    ("hosts", "devices_per_node"),
    [
        (["a", "a", "b", "b"], 2),  # one node per host
        (["a", "a", "a", "a"], 2),  # virtual nodes: two on one host
        (["a", "a", "a", "a", "b", "b", "b", "b"], 1),  # every rank its own node
    ],
)
def test_nodes_on_one_host_each_pass(hosts: list[str], devices_per_node: int) -> None:
    topology = Topology(len(hosts), 0, devices_per_node)
    assert nodes_across_hosts(topology, hosts) == {}
    assert nodes_across_hosts_problem(topology, hosts) is None


def test_ranks_numbered_round_robin_over_hosts_are_found_and_explained() -> None:
    hosts = ["a", "b", "a", "b"]  # SLURM --distribution=cyclic
    topology = Topology(4, 3, 2)
    assert nodes_across_hosts(topology, hosts) == {0: {"a": [0], "b": [1]}, 1: {"a": [2], "b": [3]}}
    problem = nodes_across_hosts_problem(topology, hosts)
    assert problem is not None
    assert "node 0 of ranks [0, 1]" in problem and "ranks [0] on 'a'; ranks [1] on 'b'" in problem
    assert "2 of 2 node(s)" in problem and "--distribution=block" in problem


def test_devices_per_node_larger_than_a_hosts_processes_is_found() -> None:
    hosts = ["a", "a", "b", "b", "c", "c", "c", "c"]  # 2, 2 and 4 processes
    topology = Topology(8, 0, 4)
    assert nodes_across_hosts(topology, hosts) == {0: {"a": [0, 1], "b": [2, 3]}}
    problem = nodes_across_hosts_problem(topology, hosts)
    assert problem is not None and "1 of 2 node(s)" in problem and "run 2 to 4 process(es) each" in problem


def test_a_node_spread_over_hosts_warns_or_refuses_hybrid_tables_on_every_rank(tmp_path: Path) -> None:
    """4 processes reporting two made-up hosts. Ranks numbered host by host: no warning, the HybridEmbedding
    model trains. Round-robin: hier_sliced and hier_bsp warn once (rank 0) and train; HybridEmbedding is
    refused on every rank with the reason, before any table segment is made. ``devices_per_node=4`` over
    two hosts warns in both layouts."""
    results = {}
    for layout in ("block", "cyclic"):
        out = tmp_path / f"{layout}.json"
        run_torchrun("host_layout_checks.py", 4, str(out), layout, timeout=420)
        results[layout] = json.loads(out.read_text())

    block, cyclic = results["block"], results["cyclic"]
    for strategy in ("hier_sliced", "hier_bsp"):
        assert block[strategy] == {"warnings": [], "steps": 3}
        assert cyclic[strategy]["steps"] == 3
        (warning,) = cyclic[strategy]["warnings"]
        assert warning.startswith(f"{strategy}: devices_per_node=2 makes node 0 of ranks [0, 1]")
        assert "ranks [0] on 'host0'; ranks [1] on 'host1'" in warning
    for layout in (block, cyclic):
        assert layout["hier_sliced_4_per_node"]["steps"] == 3
        (warning,) = layout["hier_sliced_4_per_node"]["warnings"]
        assert "devices_per_node=4 makes node 0 of ranks [0, 1, 2, 3]" in warning

    assert block["hybrid"] == {"error": None, "ranks_refused": 0, "segments_left": []}
    refused = cyclic["hybrid"]
    assert refused["ranks_refused"] == 4 and refused["segments_left"] == []
    assert refused["error"].startswith("HybridEmbedding keeps one table per node")
    assert "node 0 of ranks [0, 1]" in refused["error"]
