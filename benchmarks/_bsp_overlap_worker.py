"""One process of a ``bench_bsp_overlap.py`` job: plain-BSP ``hier_bsp`` with or without the early push,
or Lightning's ``ddp``, on an MLP; rank 0 prints one JSON line with the mean step time."""

from __future__ import annotations

import json
import sys
import time

import lightning.pytorch as pl
import torch
from harness.worker import setup
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import HierBSPStrategy, TimeBuckets


class StepClock(pl.LightningModule):
    """``layers`` x Linear(hidden, hidden) with ReLU, mean-square loss; records each step's start."""

    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.net = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(hidden, hidden), nn.ReLU())])
        self.starts: list[float] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Record the clock, then the loss."""
        self.starts.append(time.perf_counter())
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Plain SGD with a small step (the weights barely move: only time is measured)."""
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def main() -> None:
    """Train ``warmup + steps + 1`` steps; rank 0 prints ``{"mode", "step_ms", "early_buckets", ...}``."""
    config = json.loads(sys.argv[1])
    setup()
    mode, warmup, steps = config["mode"], config["warmup"], config["steps"]
    if mode == "ddp":
        strategy: object = DDPStrategy()
    else:
        timed = dict(bucketing=TimeBuckets(profile_steps=3, warmup_steps=1)) if mode == "time" else {}
        strategy = HierBSPStrategy(
            superstep=1, max_staleness=0, bucket_cap_mb=config["bucket_cap_mb"], log_supersteps=False,
            **timed,
        )  # fmt: skip
        strategy._early_push = mode in ("early", "time")  # a tuning attribute (hier_bsp's module docstring)
    total = warmup + steps + 1
    data = DataLoader(TensorDataset(torch.randn(config["batch_size"] * total * 2, config["hidden"])),
                      batch_size=config["batch_size"])  # fmt: skip
    model = StepClock(config["hidden"], config["layers"])
    trainer = pl.Trainer(
        accelerator="cpu", devices=config["processes"], strategy=strategy, max_steps=total, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, data)
    if trainer.global_rank != 0:
        return
    window = model.starts[warmup : warmup + steps + 1]
    result = {"mode": mode, "step_ms": 1000 * (window[-1] - window[0]) / steps}
    if mode != "ddp":
        records = strategy.superstep_records[warmup:]  # (time: the plan is in use from step 5 on)
        result["early_buckets"] = sum(r.early_buckets for r in records) / max(1, len(records))
        result["buckets"] = len(strategy.engine.buckets)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
