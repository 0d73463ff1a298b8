"""One training process of ``bench_hybrid_embedding.py`` (launched 4x by ``torch.distributed.run``).

Trains a click-through-style model with Lightning on CPU (gloo): bags of Zipf-distributed ids looked up
in one table and pooled by sum, concatenated with dense features, fed to a small MLP (logistic loss),
plain SGD everywhere (``hybrid``: the table's own row-wise SGD). The table is ``HybridEmbedding`` under
``HierSlicedStrategy`` (``hybrid``) or ``nn.EmbeddingBag`` under ``ddp`` (``ddp_dense``; ``ddp_sparse``
with ``sparse=True``). Every rank writes ``pid.<rank>`` in ``--signal-dir``; after ``warmup`` steps
come ``mem_steps`` steps in which the driver samples the workers' memory ("mem_start" to "start"), then
``steps`` timed steps without sampling ("start" to "end"); at each edge rank 0 hands over to the
driver. Rank 0 writes the timings as JSON to ``--out``.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from harness import cli
from harness.worker import MarkedWindow, quiet_trainer, setup
from lightning import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset

OPTIONS = """
--variant        {hybrid,ddp_dense,ddp_sparse}  required
--rows           int    2_000_000
--dim            int    128
--batch-size     int    1024  samples per process and step
--max-bag        int    8     ids per sample: uniform in 1..max-bag
--dense-features int    13
--hidden         int    256
--zipf           float  1.05  power-law exponent of the id ranks
--lr             float  0.05
--warmup         int    3
--mem-steps      int    5     steps of the memory-sampling window
--steps          int    40
--signal-dir     path   None
--out            path   required  JSON timings (written by rank 0)
"""
ID_MULTIPLIER = 999_983  # a prime: spreads the hot (low-rank) ids over the whole table


class ClickBatches(Dataset):
    """``length`` synthetic click-log batches, generated on demand (no memory that grows with the table).

    A batch is ``(ids, offsets, dense, labels)``: ``batch_size`` bags of 1..``max_bag`` ids each
    (flat ``ids`` plus ``offsets``, as ``nn.EmbeddingBag`` takes them), ``dense_features`` normal
    features per sample and a 0/1 click label.  Ids follow a bounded power law (Zipf-like, exponent
    ``zipf``) over the ranks ``0..rows-1``; rank ``r`` is id ``(r * ID_MULTIPLIER) % rows``.
    """

    def __init__(
        self,
        rows: int,
        batch_size: int,
        max_bag: int,
        dense_features: int,
        zipf: float,
        length: int,
        seed: int,
    ) -> None:
        if zipf <= 0 or zipf == 1.0:
            raise ValueError(f"zipf exponent must be positive and != 1, got {zipf}")
        self.rows = rows
        self.batch_size = batch_size
        self.max_bag = max_bag
        self.dense_features = dense_features
        self.zipf = zipf
        self.length = length
        self.seed = seed
        multiplier = ID_MULTIPLIER
        while math.gcd(multiplier, rows) != 1:
            multiplier += 2
        self.multiplier = multiplier

    def __len__(self) -> int:
        return self.length

    def sample_ids(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``n`` ids: inverse CDF of the continuous power law on ``[1, rows + 1)``, floored, hashed."""
        u = torch.rand(n, generator=generator, dtype=torch.float64)
        one_minus_s = 1.0 - self.zipf
        top = (self.rows + 1.0) ** one_minus_s
        rank = torch.pow(1.0 + u * (top - 1.0), 1.0 / one_minus_s).floor().long() - 1
        rank.clamp_(0, self.rows - 1)
        return (rank * self.multiplier) % self.rows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        lengths = torch.randint(1, self.max_bag + 1, (self.batch_size,), generator=generator)
        offsets = torch.zeros(self.batch_size, dtype=torch.long)
        offsets[1:] = lengths.cumsum(0)[:-1]
        ids = self.sample_ids(int(lengths.sum()), generator)
        dense = torch.randn(self.batch_size, self.dense_features, generator=generator)
        # a learnable label: clicks depend on the dense features and on the parity of the first id
        first = ids[offsets].float()
        logit = dense[:, 0] - 0.5 * dense[:, 1] + torch.where(first.remainder(2) == 0, 0.5, -0.5)
        labels = (torch.rand(self.batch_size, generator=generator) < torch.sigmoid(logit)).float()
        return ids, offsets, dense, labels


def make_table(variant: str, rows: int, dim: int, lr: float) -> nn.Module:
    """The embedding table of a variant (pooled by sum)."""
    if variant == "hybrid":
        from lightning_hier import HybridEmbedding

        return HybridEmbedding(rows, dim, mode="sum", optimizer="sgd", lr=lr)
    return nn.EmbeddingBag(rows, dim, mode="sum", sparse=variant == "ddp_sparse")


class ClickModel(LightningModule):
    """Sum-pooled embedding bag + dense features -> MLP -> click logit."""

    def __init__(self, table: nn.Module, dim: int, dense_features: int, hidden: int, lr: float) -> None:
        super().__init__()
        self.table = table
        self.mlp = nn.Sequential(
            nn.Linear(dim + dense_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden // 2),
            nn.ReLU(),
            nn.Linear(hidden // 2, 1),
        )
        self.lr = lr

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """Click logits, one per bag."""
        pooled = self.table(ids, offsets)
        return self.mlp(torch.cat([pooled, dense], dim=1)).squeeze(1)

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        """Binary cross-entropy on the click labels."""
        ids, offsets, dense, labels = batch
        return nn.functional.binary_cross_entropy_with_logits(self(ids, offsets, dense), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Plain SGD over the parameters (the dense MLP, plus the table for the ``nn.EmbeddingBag`` variants).

        ``torch.optim.SGD`` accepts the sparse gradients of ``nn.EmbeddingBag(sparse=True)``;
        ``HybridEmbedding`` has no parameters: it is updated by its own row-wise SGD.
        """
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class WindowTimer(MarkedWindow):
    """The marked window, with the memory window's start ("mem_start") at step ``warmup``; keeps the
    loss of every step (a sanity check that training runs)."""

    def __init__(self, warmup: int, mem_steps: int, steps: int, signal_dir: Path | None) -> None:
        super().__init__(warmup + mem_steps, steps, signal_dir, extra={warmup: "mem_start"})
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Keep the step's loss."""
        self.losses.append(float(outputs["loss"]))

    def summary(self) -> dict[str, Any]:
        """Timings of the timed window, and the first and last loss."""
        return {**super().summary(), "first_loss": self.losses[0], "last_loss": self.losses[-1]}


def make_strategy(variant: str, devices: int) -> Any:
    if variant == "hybrid":
        from lightning_hier import HierSlicedStrategy

        return HierSlicedStrategy(devices_per_node=devices)
    return "ddp"


def main() -> None:
    """Train and, on rank 0, write the timings."""
    args = cli.parser(__doc__, OPTIONS).parse_args()
    setup()
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    devices = int(os.environ["LOCAL_WORLD_SIZE"])
    if args.signal_dir is not None:
        (args.signal_dir / f"pid.{rank}").write_text(str(os.getpid()))
    total_steps = args.warmup + args.mem_steps + args.steps + 1

    table = make_table(args.variant, args.rows, args.dim, args.lr)
    model = ClickModel(table, args.dim, args.dense_features, args.hidden, args.lr)
    data = ClickBatches(
        args.rows, args.batch_size, args.max_bag, args.dense_features, args.zipf, total_steps, seed=rank
    )
    timer = WindowTimer(args.warmup, args.mem_steps, args.steps, args.signal_dir)
    trainer = quiet_trainer(
        devices=devices,
        num_nodes=world_size // devices,
        strategy=make_strategy(args.variant, devices),
        max_steps=total_steps,
        use_distributed_sampler=False,  # every rank draws its own batches (seeded by rank)
        callbacks=[timer],
    )
    t0 = time.perf_counter()
    trainer.fit(model, DataLoader(data, batch_size=None, shuffle=False, num_workers=0))
    if trainer.global_rank == 0:
        summary = timer.summary()
        samples = args.batch_size * world_size * args.steps
        result = {
            "variant": args.variant,
            "strategy_class": type(trainer.strategy).__name__,
            "table_class": type(model.table).__name__,
            "world_size": world_size,
            **{k: v for k, v in vars(args).items() if k not in ("signal_dir", "out", "variant")},
            "table_bytes": args.rows * args.dim * 4,
            "fit_s": time.perf_counter() - t0,
            "samples_per_s": samples / summary["window_s"],
            **summary,
        }
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
