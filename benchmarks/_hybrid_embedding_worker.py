"""One of the 4 training processes of a ``bench_hybrid_embedding.py`` job; its only argument is the driver's
settings as JSON; rank 0 writes ``<job_dir>/rank0.json``. The model: benchmarks/README.md."""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from harness.worker import MarkedWindow, quiet_trainer, setup
from lightning import LightningModule
from torch import nn
from torch.utils.data import DataLoader

MODEL = {"dense_features": 13, "hidden": 256, "lr": 0.05}
ID_MULTIPLIER = 999_983  # a prime: spreads the hot (low-rank) ids over the whole table


def click_batch(config: dict[str, Any], seed: int, index: int) -> tuple[torch.Tensor, ...]:
    """Synthetic click-log batch ``index``: ``(ids, offsets, dense, labels)``, ``batch_size`` bags of
    1..``max_bag`` ids (flat ids + offsets) whose ranks follow a bounded power law (exponent ``zipf``)."""
    rows, size, one_minus_s = config["rows"], config["batch_size"], 1.0 - config["zipf"]
    multiplier = next(m for m in itertools.count(ID_MULTIPLIER, 2) if math.gcd(m, rows) == 1)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    lengths = torch.randint(1, config["max_bag"] + 1, (size,), generator=generator)
    offsets = torch.zeros(size, dtype=torch.long)
    offsets[1:] = lengths.cumsum(0)[:-1]
    # ids: inverse CDF of the power law on [1, rows + 1), floored; rank r is id r * multiplier % rows
    u = torch.rand(int(lengths.sum()), generator=generator, dtype=torch.float64)
    rank = torch.pow(1.0 + u * ((rows + 1.0) ** one_minus_s - 1.0), 1.0 / one_minus_s).floor().long() - 1
    ids = (rank.clamp_(0, rows - 1) * multiplier) % rows
    dense = torch.randn(size, config["dense_features"], generator=generator)
    # a learnable label: clicks depend on the dense features and on the parity of the first id
    parity = torch.where(ids[offsets].float().remainder(2) == 0, 0.5, -0.5)
    logit = dense[:, 0] - 0.5 * dense[:, 1] + parity
    labels = (torch.rand(size, generator=generator) < torch.sigmoid(logit)).float()
    return ids, offsets, dense, labels


class ClickModel(LightningModule):
    """Sum-pooled embedding bag + dense features -> MLP -> click logit; keeps every step's loss."""

    def __init__(self, table: nn.Module, dim: int, dense_features: int, hidden: int, lr: float) -> None:
        super().__init__()
        self.table = table
        sizes = [dim + dense_features, hidden, hidden // 2]
        layers = [layer for n, m in zip(sizes, sizes[1:]) for layer in (nn.Linear(n, m), nn.ReLU())]
        self.mlp = nn.Sequential(*layers, nn.Linear(hidden // 2, 1))
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        """Binary cross-entropy on the click labels."""
        ids, offsets, dense, labels = batch
        logits = self.mlp(torch.cat([self.table(ids, offsets), dense], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Plain SGD (it takes ``ddp_sparse``'s sparse gradients; ``HybridEmbedding`` has no parameters)."""
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def main() -> None:
    """Train: ``warmup`` steps, the memory window, the timed window, one more step; rank 0 writes timings."""
    config = {**MODEL, **json.loads(sys.argv[1])}
    job_dir = Path(config.pop("job_dir"))
    setup()
    rank, devices, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE"))
    (job_dir / f"pid.{rank}").write_text(str(os.getpid()))
    variant, rows, dim, lr = config["variant"], config["rows"], config["dim"], config["lr"]
    if variant == "hybrid":  # one table per node in /dev/shm, updated by its own row-wise SGD
        from lightning_hier import HierSlicedStrategy, HybridEmbedding

        merge = config.get("node_merge", "leader")
        table: nn.Module = HybridEmbedding(rows, dim, mode="sum", optimizer="sgd", lr=lr, node_merge=merge)
        strategy: Any = HierSlicedStrategy(devices_per_node=devices)
    else:
        table, strategy = nn.EmbeddingBag(rows, dim, mode="sum", sparse=variant == "ddp_sparse"), "ddp"
    model = ClickModel(table, dim, config["dense_features"], config["hidden"], lr)
    result = fit_and_measure(config, job_dir, model, strategy)
    if result is not None:
        result["table_class"] = type(table).__name__
        (job_dir / "rank0.json").write_text(json.dumps(result, indent=2))


def fit_and_measure(
    config: dict[str, Any], job_dir: Path, model: LightningModule, strategy: Any
) -> dict[str, Any] | None:
    """Fit ``model`` for the warm-up, the memory window, the timed window and one more step; on rank 0 the
    result (the config, timings, samples/s, losses), elsewhere ``None``."""
    rank, devices, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE"))
    warmup, steps = config["warmup"], config["steps"]
    first = warmup + config["mem_steps"]
    window = MarkedWindow(first, steps, job_dir, extra={warmup: "mem_start"})
    total = first + steps + 1
    trainer = quiet_trainer(
        devices=devices,
        num_nodes=world // devices,
        strategy=strategy,
        max_steps=total,
        use_distributed_sampler=False,
        callbacks=[window],
    )
    # batch i is made from index i when it is fetched (every rank draws its own, seeded by rank)
    batches = DataLoader(range(total), batch_size=None, collate_fn=partial(click_batch, config, rank))
    t0 = time.perf_counter()
    trainer.fit(model, batches)
    if trainer.global_rank != 0:
        return None
    timings = window.summary()
    result = {**config, "strategy_class": type(trainer.strategy).__name__, "world_size": world}
    result.update(table_bytes=config["rows"] * config["dim"] * 4)
    samples_per_s = config["batch_size"] * world * steps / timings["window_s"]
    result.update(fit_s=time.perf_counter() - t0, samples_per_s=samples_per_s, **timings)
    result.update(first_loss=model.losses[0], last_loss=model.losses[-1])
    return result


if __name__ == "__main__":
    main()
