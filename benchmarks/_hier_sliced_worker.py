"""One training process of ``bench_hier_sliced.py`` (launched 4x, torchrun-style env vars).

Trains a communication-bound MLP with Lightning on CPU (gloo) for ``warmup + steps + 1`` steps. At the
start of step ``warmup`` ("start") and of step ``warmup + steps`` ("end") all ranks meet in a barrier
and rank 0 hands over to the driver (marker files in ``--signal-dir``), which reads the nodes'
``tx_bytes`` while no gradient traffic is in flight; so the window covers exactly ``steps`` steps,
start to start, and communication deferred into the next step is counted once per step as well.
Rank 0 writes its timings as JSON to ``--out``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from harness import cli
from harness.worker import MLP, MarkedWindow, quiet_trainer, setup
from lightning import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

OPTIONS = """
--strategy      {ddp,hier_sliced}  ddp
--hidden        int    1024
--layers        int    6
--batch-size    int    8
--warmup        int    3
--steps         int    8
--bucket-cap-mb float  25.0
--signal-dir    path   None
--out           path   required  JSON timings (written by rank 0)
"""


class PhaseTimer(MarkedWindow):
    """The marked window, plus the in-batch duration (forward, backward, optimizer) of measured steps."""

    def __init__(self, warmup: int, steps: int, signal_dir: Path | None) -> None:
        super().__init__(warmup, steps, signal_dir)
        self.batch_times: list[float] = []
        self._batch_t0 = 0.0

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Record the step's start (after a hand-over)."""
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._batch_t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Record the in-batch duration of measured steps."""
        if self.first <= batch_idx < self.first + self.steps:
            self.batch_times.append(time.perf_counter() - self._batch_t0)

    def summary(self) -> dict[str, Any]:
        """Timings of the measured window."""
        summary = super().summary()
        return {"step_times_s": summary["step_times_s"], "batch_times_s": self.batch_times, **summary}


def make_strategy(name: str, devices_per_node: int, bucket_cap_mb: float) -> Any:
    """Lightning's DDP or a HierSlicedStrategy (imported lazily), both with the same bucket cap."""
    if name == "hier_sliced":
        from lightning_hier import HierSlicedStrategy

        return HierSlicedStrategy(devices_per_node=devices_per_node, bucket_cap_mb=bucket_cap_mb)
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(bucket_cap_mb=bucket_cap_mb)


def make_loader(hidden: int, batch_size: int, world_size: int, total_steps: int) -> DataLoader:
    """Random regression data, enough for ``total_steps`` batches on every rank in one epoch."""
    gen = torch.Generator().manual_seed(0)
    n = batch_size * world_size * (total_steps + 2)
    data = TensorDataset(torch.randn(n, hidden, generator=gen), torch.randn(n, hidden, generator=gen))
    return DataLoader(data, batch_size=batch_size, shuffle=False)


def main() -> None:
    """Train and, on rank 0, write the timings."""
    args = cli.parser(__doc__, OPTIONS).parse_args()
    setup()
    world_size, devices_per_node = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    num_nodes = world_size // devices_per_node
    total_steps = args.warmup + args.steps + 1
    model = MLP(args.hidden, args.layers, lr=1e-3)
    # before fit: a strategy may re-layout or shard parameters
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    timer = PhaseTimer(args.warmup, args.steps, args.signal_dir)
    strategy = make_strategy(args.strategy, devices_per_node, args.bucket_cap_mb)
    trainer = quiet_trainer(
        devices=devices_per_node,
        num_nodes=num_nodes,
        strategy=strategy,
        max_steps=total_steps,
        callbacks=[timer],
    )
    t0 = time.perf_counter()
    trainer.fit(model, make_loader(args.hidden, args.batch_size, world_size, total_steps))
    if trainer.global_rank == 0:
        result = {
            "strategy": args.strategy,
            "strategy_class": type(trainer.strategy).__name__,
            "world_size": world_size,
            "num_nodes": num_nodes,
            "devices_per_node": devices_per_node,
            **{k: getattr(args, k) for k in ("hidden", "layers", "batch_size", "warmup", "steps")},
            "grad_bytes": grad_bytes,
            "fit_s": time.perf_counter() - t0,
            **timer.summary(),
        }
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
