"""Run under torchrun (2 processes, one node): each strategy fits twice (two Trainers) in one process.

``group_lifecycle_checks.py OUT`` fits ``hier_sliced`` (with a ``HybridEmbedding``: its tables' groups
too), ``hier_bsp``, ``hier_pipeline`` (2 stages) and ``ddp``, each twice with ``timeout=TIMEOUT``, and
counts the process groups this process holds after each fit. Every rank writes ``OUT.rank<N>.json``:
per strategy the two counts, every group's timeout in seconds and the backend configurations of the
groups the package built for host data and for device tensors (``dist.get_backend_config``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
from hybrid_checks import Click  # noqa: E402
from hybrid_checks import loader as hybrid_loader  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from models import EquivModel, loader  # noqa: E402
from pipeline_models import SkewedNet  # noqa: E402
from pipeline_models import loader as pipeline_loader  # noqa: E402

from lightning_hier import HierBSPStrategy, HierPipelineStrategy, HierSlicedStrategy  # noqa: E402

TIMEOUT = timedelta(seconds=97)


def group_count() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def timeouts_s() -> list[float]:
    """Every group's timeout (each backend's, cpu first), in seconds."""
    seconds = []
    for group in dist.distributed_c10d._world.pg_map:
        backend = group._get_backend(torch.device("cpu"))
        seconds.append(backend.options._timeout.total_seconds())
    return sorted(set(seconds))


def fit(strategy: Any, model: pl.LightningModule, data: Callable[[], Any], **kwargs: Any) -> None:
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, **kwargs,
    )  # fmt: skip
    trainer.fit(model, data())


def twice(
    make: Callable[[], Any], model: Callable[[], pl.LightningModule], data: Callable[[], Any], **kw: Any
) -> tuple[list[int], list[Any]]:
    """Two fits, each with a new strategy and Trainer; the group counts after each and the strategies."""
    counts, strategies = [], []
    for _ in range(2):
        strategy = make()
        fit(strategy, model(), data, **kw)
        counts.append(group_count())
        strategies.append(strategy)
    return counts, strategies


def config(group: Any) -> str:
    return dist.get_backend_config(group)


def main() -> None:
    out = Path(sys.argv[1])
    pl.seed_everything(0, verbose=False)
    results: dict[str, Any] = {}

    counts, (_, sliced) = twice(
        lambda: HierSlicedStrategy(devices_per_node=2, timeout=TIMEOUT),
        lambda: Click(hybrid=True, optimizer="sgd"),
        hybrid_loader,
        use_distributed_sampler=False,
    )
    exchange = sliced._table_exchange
    results["hier_sliced"] = {
        "counts": counts,
        "host_only": [config(g) for g in (exchange.intra_group, exchange.inter_group, exchange.world_group)],
        "device": [config(sliced.topology.intra_group), config(sliced.topology.inter_group)],
    }

    counts, (_, bsp) = twice(
        lambda: HierBSPStrategy(superstep=1, max_staleness=0, devices_per_node=2, timeout=TIMEOUT),
        EquivModel,
        loader,
    )
    groups = bsp.engine.topology
    results["hier_bsp"] = {
        "counts": counts,
        "host_only": [config(groups.world_group)],
        "device": [config(groups.intra_group), config(groups.inter_group)],
    }

    counts, _ = twice(
        lambda: HierPipelineStrategy(micro_batches=2, rebalance="never", timeout=TIMEOUT),
        SkewedNet,
        pipeline_loader,
    )
    results["hier_pipeline"] = {"counts": counts}

    counts, _ = twice(lambda: DDPStrategy(timeout=TIMEOUT), EquivModel, loader)
    results["ddp"] = {"counts": counts}

    results["timeouts_s"] = timeouts_s()
    Path(f"{out}.rank{os.environ['RANK']}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
