"""One stage process of ``bench_pipeline_memory.py`` (launched twice by ``torch.distributed.run``).

``python _pipeline_memory_worker.py CONFIG_JSON OUT``: trains ``config["blocks"]`` blocks
``x + Linear(4W, W)(gelu(Linear(W, 4W)(x)))`` (W = ``config["width"]``, each block one layer) with
``HierPipelineStrategy`` (1F1B, ``config["policy"]`` and ``config["memory_limit"]``). After
``config["warmup"]`` steps (the plan is made at the last) the stages' activation peaks are reset;
rank 0 writes every stage's measured peak, plan and compute time and the measured step times to OUT.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from harness.worker import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import HierPipelineStrategy


def worker(config: dict[str, Any], out: Path) -> None:
    """Train with ``config``; rank 0 writes the stages' peaks and plans and the step times to ``out``."""
    width, blocks = config["width"], config["blocks"]

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(nn.functional.gelu(self.up(x)))

    class Stack(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*(Block() for _ in range(blocks)))
            self.head = nn.Linear(width, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(x))

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    steps = config["warmup"] + config["steps"]
    g = torch.Generator().manual_seed(0)
    n = config["batch_size"] * steps
    data = TensorDataset(torch.randn(n, width, generator=g), torch.randint(0, 10, (n,), generator=g))

    step_times: list[float] = []

    class Clock(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
            step_times.append(time.perf_counter() - self.start)

    pl.seed_everything(0, verbose=False)
    strategy = HierPipelineStrategy(
        micro_batches=config["micro_batches"],
        schedule="1f1b",
        partition="uniform",
        rebalance="never",
        profile_steps=config["warmup"] - 1,
        leaf_modules=[f"blocks.{i}" for i in range(blocks)],
        activation_policy=config["policy"],
        memory_limit=config.get("memory_limit"),
    )
    trainer = quiet_trainer(
        devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_steps=steps, callbacks=[Clock()]
    )
    engine_ref: list[Any] = []

    class ResetPeak(pl.Callback):
        """The measured window starts after the plan: peaks are measured from there on."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
            if batch_idx == config["warmup"] and strategy.engine is not None and strategy.engine.meter:
                strategy.engine.meter.reset_peak()
                engine_ref.append(strategy.engine)

    trainer.callbacks.append(ResetPeak())
    trainer.fit(Stack(), DataLoader(data, batch_size=config["batch_size"]))
    engine = strategy.engine
    assert engine is not None and engine.meter is not None
    mine = {
        "stage": engine.stage,
        "base_bytes": engine.base_bytes(),
        "activation_peak_bytes": engine.meter.peak_bytes,
        "measured_peak_bytes": engine.measured_peak_bytes(),
        "plan": str(engine.memory_plan) if engine.memory_plan is not None else config["policy"],
        "policies": dict(engine.executor.policies),
        # per micro-batch: the stage's own compute (forward + backward of its layers), no waiting
        "compute_s_per_micro_batch": sum(
            f + b for f, b in engine.executor.times.summary(engine.executor.layer_range).values()
        ),
    }
    stages: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(stages, mine)
    if trainer.is_global_zero:
        measured = step_times[config["warmup"] :]
        result = {
            "config": config,
            "stages": sorted(stages, key=lambda s: s["stage"]),
            "step_times_s": measured,
            "samples_per_s": config["batch_size"] * len(measured) / sum(measured),
        }
        out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]), Path(sys.argv[2]))
