"""A 2-node x 2-device job launched as a cluster launches it (one Lightning process per node, which starts
the node's other process): ``hier_sliced`` and plain ``hier_bsp`` resolve the layout from Lightning's
``num_nodes`` and ``devices`` and train to ``ddp``'s weights under the same launch."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import SCRIPTS, free_port
from scripts.train_equivalence import max_rel_diff


def launch_two_nodes(out: Path, strategy: str) -> dict[int, dict]:
    """Start both node processes of ``two_node_launch.py``; return every rank's layout report."""
    out.mkdir()
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": port}  # fmt: skip
    for var in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(var, None)
    log = out / "log.txt"
    with open(log, "wb") as sink:
        nodes = [
            subprocess.Popen(
                [sys.executable, str(SCRIPTS / "two_node_launch.py"), str(out), strategy],
                env={**env, "NODE_RANK": str(node)},
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
            for node in range(2)
        ]
        try:
            codes = [node.wait(timeout=240) for node in nodes]
        finally:
            for node in nodes:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(node.pid, signal.SIGKILL)
    assert codes == [0, 0], log.read_text()[-6000:]
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(4)}


@pytest.fixture(scope="module")
def ddp_weights(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("two_nodes") / "ddp"
    launch_two_nodes(out, "ddp")
    return torch.load(out / "weights.pt")


@pytest.mark.parametrize("strategy", ["hier_sliced", "hier_bsp"])
def test_two_nodes_launched_per_node_train_to_ddps_weights(
    tmp_path: Path, strategy: str, ddp_weights: dict
) -> None:
    layouts = launch_two_nodes(tmp_path / strategy, strategy)
    for rank, layout in layouts.items():
        # Lightning numbers ranks node by node; the strategy's nodes are the launch's nodes
        assert (layout["node_rank"], layout["local_rank"]) == divmod(rank, 2), layout
        assert layout["world_size"] == 4 and layout["devices_per_node"] == 2, layout
        assert layout["topology_rank"] == rank, layout
        assert layout["global_step"] == 2 * 256 // (4 * 8), layout  # every rank took every step
    weights = torch.load(tmp_path / strategy / "weights.pt")
    assert sorted(weights) == sorted(ddp_weights)
    assert max_rel_diff(ddp_weights, weights) < 1e-5
    import lightning.pytorch as pl
    from scripts.models import EquivModel

    pl.seed_everything(5, verbose=False)  # the script's start
    start = EquivModel(optimizer="sgd", quirks=True, batch_norm=True, scheduler=True).state_dict()
    assert max_rel_diff(start, ddp_weights) > 1e-3  # the reference trained: not a comparison of starts
