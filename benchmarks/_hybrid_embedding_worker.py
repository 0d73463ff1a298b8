"""One training process of ``bench_hybrid_embedding.py`` (launched 4x by ``torch.distributed.run``).

Trains a click-through-style model with Lightning on CPU (gloo): one embedding table looked up
as bags of Zipf-distributed ids (pooled by sum), concatenated with a few dense features and fed
to a small MLP with a logistic loss.  The table is one of

* ``hybrid``:     ``HybridEmbedding(mode="sum", optimizer="sgd")`` under
  ``HierSlicedStrategy(devices_per_node=4)`` (one copy per node in ``/dev/shm``);
* ``ddp_dense``:  ``nn.EmbeddingBag(mode="sum")`` under Lightning's ``ddp``;
* ``ddp_sparse``: ``nn.EmbeddingBag(mode="sum", sparse=True)`` under Lightning's ``ddp``.

Every variant trains with plain SGD at the same learning rate (the table's own row-wise SGD for
``hybrid``).  After ``warmup`` steps come two windows: ``mem_steps`` steps in which the driver
samples the workers' memory, then ``steps`` timed steps without sampling (reading
``smaps_rollup`` of four processes that map gigabytes costs the driver ~0.1 CPU-second, which
would slow the timed steps on a small host).  The edges are handshaken with the driver through
marker files in ``--signal-dir``:

* at start-up every rank writes ``pid.<rank>`` (the driver reads these processes' PSS);
* at ``on_train_batch_start`` of steps ``warmup`` ("mem_start"), ``warmup + mem_steps``
  ("start") and ``warmup + mem_steps + steps`` ("end") all ranks meet in a barrier, rank 0 writes
  ``<phase>.ready`` and waits for the driver's ``<phase>.ack`` (the driver takes a memory sample
  meanwhile), and all ranks meet in a second barrier.  Between "mem_start" and "start" the driver
  keeps sampling while the ranks train.

The trainer runs ``warmup + mem_steps + steps + 1`` steps; rank 0 times the ``steps`` timed steps
start to start (the handshakes lie outside) and writes the timings as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, Dataset

VARIANTS = ("hybrid", "ddp_dense", "ddp_sparse")
ACK_TIMEOUT_S = 300.0
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


def wait_for_ack(signal_dir: Path, phase: str, timeout_s: float = ACK_TIMEOUT_S) -> None:
    """Announce ``phase`` to the driver and block until it acknowledges (it samples memory meanwhile)."""
    ack = signal_dir / f"{phase}.ack"
    ready = signal_dir / f"{phase}.ready"
    ready.with_suffix(".tmp").write_text(str(time.time()))
    ready.with_suffix(".tmp").rename(ready)
    deadline = time.monotonic() + timeout_s
    while not ack.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"driver did not acknowledge phase {phase!r} within {timeout_s} s")
        time.sleep(0.002)


class WindowTimer(Callback):
    """Handshakes the windows' edges; times steps ``[first, first + steps)`` start to start."""

    def __init__(self, warmup: int, mem_steps: int, steps: int, signal_dir: Path | None) -> None:
        self.warmup = warmup
        self.first = warmup + mem_steps
        self.steps = steps
        self.signal_dir = signal_dir
        self.step_starts: list[float] = []
        self.losses: list[float] = []

    def _boundary(self, trainer: Trainer, phase: str) -> None:
        dist.barrier()
        if trainer.global_rank == 0 and self.signal_dir is not None:
            wait_for_ack(self.signal_dir, phase)
        dist.barrier()

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Record step starts; handshake at the start and end of the window."""
        if batch_idx == self.warmup:
            self._boundary(trainer, "mem_start")
        if batch_idx == self.first + self.steps:
            self.step_starts.append(time.perf_counter())
            self._boundary(trainer, "end")
        elif batch_idx == self.first:
            self._boundary(trainer, "start")
            self.step_starts.append(time.perf_counter())
        elif self.first < batch_idx < self.first + self.steps:
            self.step_starts.append(time.perf_counter())

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Keep the loss of every step (a sanity check that training runs)."""
        self.losses.append(float(outputs["loss"]))

    def summary(self) -> dict[str, Any]:
        intervals = [b - a for a, b in zip(self.step_starts, self.step_starts[1:])]
        if len(intervals) != self.steps:
            raise RuntimeError(f"expected {self.steps} measured steps, timed {len(intervals)}")
        return {
            "step_times_s": intervals,
            "window_s": self.step_starts[-1] - self.step_starts[0],
            "mean_step_s": statistics.fmean(intervals),
            "median_step_s": statistics.median(intervals),
            "first_loss": self.losses[0],
            "last_loss": self.losses[-1],
        }


def make_strategy(variant: str, devices: int) -> Any:
    if variant == "hybrid":
        from lightning_hier import HierSlicedStrategy

        return HierSlicedStrategy(devices_per_node=devices)
    return "ddp"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--variant", required=True, choices=VARIANTS)
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1024, help="samples per process and step")
    p.add_argument("--max-bag", type=int, default=8, help="ids per sample: uniform in 1..max-bag")
    p.add_argument("--dense-features", type=int, default=13)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--zipf", type=float, default=1.05, help="power-law exponent of the id ranks")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--mem-steps", type=int, default=5, help="steps of the memory-sampling window")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--signal-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, required=True, help="JSON timings (written by rank 0)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    devices = int(os.environ["LOCAL_WORLD_SIZE"])
    if args.signal_dir is not None:
        (args.signal_dir / f"pid.{rank}").write_text(str(os.getpid()))
    total_steps = args.warmup + args.mem_steps + args.steps + 1

    model = ClickModel(
        make_table(args.variant, args.rows, args.dim, args.lr),
        args.dim,
        args.dense_features,
        args.hidden,
        args.lr,
    )
    data = ClickBatches(
        args.rows, args.batch_size, args.max_bag, args.dense_features, args.zipf, total_steps, seed=rank
    )
    timer = WindowTimer(args.warmup, args.mem_steps, args.steps, args.signal_dir)
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=world_size // devices,
        strategy=make_strategy(args.variant, devices),
        max_steps=total_steps,
        use_distributed_sampler=False,  # every rank draws its own batches (seeded by rank)
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
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
