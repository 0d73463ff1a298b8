"""Run under torchrun (4 processes): nodes whose ranks run on different hosts.

``host_layout_checks.py OUT LAYOUT``. Every process reports a made-up host name: ``block`` puts ranks 0, 1
on ``host0`` and 2, 3 on ``host1`` (Lightning's node-major numbering), ``cyclic`` puts the even ranks on
``host0`` and the odd ones on ``host1`` (SLURM's ``--distribution=cyclic``). Each strategy then fits 2 x 2;
rank 0 writes, per scenario, the warnings about hosts, the steps taken, or the error raised (and by how many
ranks), and the node-shared segments a refused HybridEmbedding left in shared memory.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import hybrid_checks  # noqa: E402
from models import EquivModel, loader  # noqa: E402

from lightning_hier import HierBSPStrategy, HierSlicedStrategy  # noqa: E402
from lightning_hier.sparse.shared_store import segment_dir  # noqa: E402

RANK = int(os.environ["RANK"])


def fake_host(layout: str) -> str:
    return f"host{RANK // 2}" if layout == "block" else f"host{RANK % 2}"


def trainer(strategy: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )  # fmt: skip


def host_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "different hosts" in str(w.message)]


def fit_dense(strategy: Any) -> dict[str, Any]:
    """A dense model: it trains, with a warning on rank 0 where a node spans hosts."""
    run = trainer(strategy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(EquivModel(), train_dataloaders=loader())
    return {"warnings": host_warnings(caught), "steps": run.global_step}


def fit_hybrid() -> dict[str, Any]:
    """HybridEmbedding under hier_sliced: refused on every rank before any table segment exists."""
    mine = f"{os.getuid()}-{os.getpid()}-"
    error = None
    try:
        model, data = hybrid_checks.Click(True, "sgd"), hybrid_checks.loader()
        trainer(HierSlicedStrategy(devices_per_node=2)).fit(model, train_dataloaders=data)
    except ValueError as raised:
        error = str(raised)
    segments = [p.name for p in segment_dir().glob(f"lightning_hier-{mine}*")]
    refused = [None] * dist.get_world_size()
    dist.all_gather_object(refused, error is not None)  # every rank raised (none waits in a collective)
    return {"error": error, "ranks_refused": sum(refused), "segments_left": segments}


def main() -> None:
    out, layout = Path(sys.argv[1]), sys.argv[2]
    host = fake_host(layout)
    socket.gethostname = lambda: host  # what the strategies read as this process's host
    results = {
        "hier_sliced": fit_dense(HierSlicedStrategy(devices_per_node=2)),
        "hier_bsp": fit_dense(HierBSPStrategy(devices_per_node=2, superstep=1, max_staleness=0)),
        "hier_sliced_4_per_node": fit_dense(HierSlicedStrategy(devices_per_node=4)),
        "hybrid": fit_hybrid(),
    }
    if RANK == 0:
        out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
