"""One training process of ``bench_hier_sliced.py`` (launched 4x, torchrun-style env vars).

Trains a communication-bound MLP with Lightning on CPU (gloo) and times the
measured steps.  Phase boundaries are handshaken with the driver through
marker files so that it can read the nodes' ``tx_bytes`` while no gradient
traffic is in flight:

* at ``on_train_batch_start`` of step ``warmup`` ("start") and of step
  ``warmup + steps`` ("end") all ranks meet in a barrier, rank 0 writes
  ``<signal-dir>/<phase>.ready`` and waits for the driver's ``<phase>.ack``,
  and all ranks meet in a second barrier before training continues.

The trainer runs ``warmup + steps + 1`` steps; the window between the two
boundaries covers exactly ``steps`` full steps (start-to-start), so
communication a strategy defers into the next step's forward is counted once
per step as well.  Rank 0 writes its timings as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
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
from torch.utils.data import DataLoader, TensorDataset

ACK_TIMEOUT_S = 300.0


class CommBoundMLP(LightningModule):
    """``layers`` x Linear(hidden, hidden) with ReLU: many gradient bytes, little compute."""

    def __init__(self, hidden: int, layers: int, lr: float = 1e-3) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        for _ in range(layers):
            blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
        self.net = nn.Sequential(*blocks[:-1])
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP."""
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Mean squared error against a random target."""
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Plain SGD: no optimizer state, cheap step."""
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def gradient_bytes(module: nn.Module) -> int:
    """Bytes of all gradients (parameters that require grad)."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def wait_for_ack(signal_dir: Path, phase: str, timeout_s: float = ACK_TIMEOUT_S) -> None:
    """Announce ``phase`` to the driver and block until it acknowledges (it reads counters meanwhile)."""
    ack = signal_dir / f"{phase}.ack"
    ready = signal_dir / f"{phase}.ready"
    ready.with_suffix(".tmp").write_text(str(time.time()))
    ready.with_suffix(".tmp").rename(ready)
    deadline = time.monotonic() + timeout_s
    while not ack.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"driver did not acknowledge phase {phase!r} within {timeout_s} s")
        time.sleep(0.002)


class PhaseTimer(Callback):
    """Times steps ``[warmup, warmup + steps)`` and handshakes phase boundaries with the driver."""

    def __init__(self, warmup: int, steps: int, signal_dir: Path | None) -> None:
        self.warmup = warmup
        self.steps = steps
        self.signal_dir = signal_dir
        self.step_starts: list[float] = []
        self.batch_times: list[float] = []
        self._batch_t0 = 0.0

    def _boundary(self, trainer: Trainer, phase: str) -> None:
        """Quiesce all ranks, let rank 0 handshake with the driver, and release them together."""
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        if trainer.global_rank == 0 and self.signal_dir is not None:
            wait_for_ack(self.signal_dir, phase)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Record step start; handle the start/end boundaries."""
        if batch_idx == self.warmup + self.steps:
            self.step_starts.append(time.perf_counter())
            self._boundary(trainer, "end")
        elif batch_idx == self.warmup:
            self._boundary(trainer, "start")
            self.step_starts.append(time.perf_counter())
        elif self.warmup < batch_idx < self.warmup + self.steps:
            self.step_starts.append(time.perf_counter())
        self._batch_t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Record the in-batch duration (forward, backward, optimizer) of measured steps."""
        if self.warmup <= batch_idx < self.warmup + self.steps:
            self.batch_times.append(time.perf_counter() - self._batch_t0)

    def summary(self) -> dict[str, Any]:
        """Timings of the measured window."""
        intervals = [b - a for a, b in zip(self.step_starts, self.step_starts[1:], strict=False)]
        if len(intervals) != self.steps:
            raise RuntimeError(f"expected {self.steps} measured steps, timed {len(intervals)}")
        return {
            "step_times_s": intervals,
            "batch_times_s": self.batch_times,
            "window_s": self.step_starts[-1] - self.step_starts[0],
            "mean_step_s": statistics.fmean(intervals),
            "median_step_s": statistics.median(intervals),
        }


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


def parse_args() -> argparse.Namespace:
    """Command line of one worker."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--strategy", default="ddp", choices=["ddp", "hier_sliced"])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--signal-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, required=True, help="JSON timings (written by rank 0)")
    return p.parse_args()


def main() -> None:
    """Train and, on rank 0, write the timings."""
    args = parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    world_size = int(os.environ["WORLD_SIZE"])
    devices_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    num_nodes = world_size // devices_per_node
    total_steps = args.warmup + args.steps + 1

    model = CommBoundMLP(args.hidden, args.layers)
    grad_bytes = gradient_bytes(model)  # before fit: a strategy may re-layout or shard parameters
    timer = PhaseTimer(args.warmup, args.steps, args.signal_dir)
    trainer = Trainer(
        accelerator="cpu",
        devices=devices_per_node,
        num_nodes=num_nodes,
        strategy=make_strategy(args.strategy, devices_per_node, args.bucket_cap_mb),
        max_steps=total_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
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
            "hidden": args.hidden,
            "layers": args.layers,
            "batch_size": args.batch_size,
            "warmup": args.warmup,
            "steps": args.steps,
            "grad_bytes": grad_bytes,
            "fit_s": time.perf_counter() - t0,
            **timer.summary(),
        }
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
