"""What the worker processes share: set-up, a quiet Trainer, the handshake with the driver, step timing."""

from __future__ import annotations

import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning import Callback, LightningModule, Trainer
from torch import nn

ACK_TIMEOUT_S = 300.0


def setup(interop_threads: bool = False) -> None:
    """One compute thread (and one inter-op thread), no warnings, seed 0, Python's ABC cache warm."""
    torch.set_num_threads(1)
    if interop_threads:
        torch.set_num_interop_threads(1)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    # torchmetrics' Metric is an ABC with hundreds of subclasses: the first isinstance(tensor, Metric),
    # made by the first self.log of a run, walks them all (~0.45 s once on a 2-core CPU). Pay it here,
    # before any clock starts, for every contender alike (otherwise it lands in whichever first step
    # happens to make that check first).
    from torchmetrics import Metric

    isinstance(torch.zeros(1), Metric)


def quiet_trainer(accelerator: str = "cpu", **kwargs: Any) -> Trainer:
    """A ``Trainer`` (CPU unless told) without logger, checkpoints, progress bar or model summary."""
    return Trainer(
        accelerator=accelerator,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


class MLP(LightningModule):
    """``layers`` x Linear(hidden, hidden) with ReLU in between, MSE loss, plain SGD: many gradient
    bytes for little compute."""

    def __init__(self, hidden: int, layers: int, lr: float) -> None:
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


def wait_for_ack(signal_dir: Path, phase: str, timeout_s: float = ACK_TIMEOUT_S) -> None:
    """Announce ``phase`` to the driver and block until it acknowledges (it measures meanwhile)."""
    ack = signal_dir / f"{phase}.ack"
    ready = signal_dir / f"{phase}.ready"
    ready.with_suffix(".tmp").write_text(str(time.time()))
    ready.with_suffix(".tmp").rename(ready)
    deadline = time.monotonic() + timeout_s
    while not ack.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"driver did not acknowledge phase {phase!r} within {timeout_s} s")
        time.sleep(0.002)


def handshake(trainer: Trainer, signal_dir: Path | None, phase: str) -> None:
    """Quiesce all ranks, let rank 0 hand over to the driver, and release the ranks together."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    if trainer.global_rank == 0 and signal_dir is not None:
        wait_for_ack(signal_dir, phase)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def step_times(starts: list[float], steps: int, note: str = "") -> list[float]:
    """Start-to-start times of ``steps`` steps; raises when there are not exactly that many."""
    intervals = [b - a for a, b in zip(starts, starts[1:])]
    if len(intervals) != steps:
        raise RuntimeError(f"expected {steps} measured steps, timed {len(intervals)}{note}")
    return intervals


class MarkedWindow(Callback):
    """Times steps ``[first, first + steps)`` start to start; at both edges (phases "start" and "end",
    outside the timed steps) and at the steps in ``extra`` rank 0 hands over to the driver."""

    def __init__(
        self, first: int, steps: int, signal_dir: Path | None, extra: dict[int, str] | None = None
    ) -> None:
        self.first = first
        self.steps = steps
        self.signal_dir = signal_dir
        self.extra = extra or {}
        self.step_starts: list[float] = []

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Record step starts; hand over at the window's edges."""
        if batch_idx in self.extra:
            handshake(trainer, self.signal_dir, self.extra[batch_idx])
        if batch_idx == self.first + self.steps:
            self.mark_step()
            handshake(trainer, self.signal_dir, "end")
        elif batch_idx == self.first:
            handshake(trainer, self.signal_dir, "start")
            self.mark_step()
        elif self.first < batch_idx < self.first + self.steps:
            self.mark_step()

    def mark_step(self) -> None:
        """Record a step start (a subclass may sample more here); on CUDA once the device is done."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self.step_starts.append(time.perf_counter())

    def summary(self) -> dict[str, Any]:
        """Timings of the window."""
        intervals = step_times(self.step_starts, self.steps)
        return {
            "step_times_s": intervals,
            "window_s": self.step_starts[-1] - self.step_starts[0],
            "mean_step_s": statistics.fmean(intervals),
            "median_step_s": statistics.median(intervals),
        }
