"""One ``torch.distributed.run`` job of ``bench_pipeline_one_stage.py`` (one process): the same training
under Lightning's single-device strategy accumulating M micro-batches and under a one-stage
``hier_pipeline`` splitting each batch into M; rank 0 writes ``JOB_DIR/result.json``.

``_pipeline_one_stage_worker.py CONFIG_JSON JOB_DIR``; CONFIG_JSON holds modes, rounds, hidden, layers,
batch_size, micro_batches, warmup, steps and gpu.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from harness.worker import MLP, quiet_trainer, setup
from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import HierPipelineStrategy


class Window(Callback):
    """Wall time of the batches ``[first, first + count)``, the device synchronized at the two edges."""

    def __init__(self, first: int, count: int) -> None:
        self.first, self.count, self.edges = first, count, []

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, idx: int
    ) -> None:
        if idx in (self.first, self.first + self.count):
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            self.edges.append(time.perf_counter())


def fit_once(config: dict[str, Any], mode: str, device: torch.device) -> float:
    """Time per optimizer step over the measured window of one fit."""
    torch.manual_seed(0)
    hidden, micro = config["hidden"], config["micro_batches"]
    steps = config["warmup"] + config["steps"] + 1
    samples = steps * config["batch_size"]
    data = TensorDataset(torch.randn(samples, hidden), torch.randn(samples, hidden))
    if mode == "single":  # a batch is a micro-batch; an optimizer step every M of them
        batch, per_step, extra = config["batch_size"] // micro, micro, {"accumulate_grad_batches": micro}
        strategy: Any = SingleDeviceStrategy(device=device)
    else:
        batch, per_step, extra = config["batch_size"], 1, {}
        strategy = HierPipelineStrategy(
            micro_batches=micro,
            # pipeline_timed: the default rebalance="epoch", so one micro-batch per step is timed per layer
            rebalance="epoch" if mode == "pipeline_timed" else "never",
            static_shapes=mode == "pipeline_static",
        )
    window = Window(config["warmup"] * per_step, config["steps"] * per_step)
    trainer = quiet_trainer(
        accelerator="gpu" if config["gpu"] else "cpu", devices=1, strategy=strategy, max_epochs=1,
        callbacks=[window], **extra,
    )  # fmt: skip
    trainer.fit(MLP(hidden, config["layers"], 1e-4), DataLoader(data, batch_size=batch))
    return (window.edges[1] - window.edges[0]) / config["steps"]


def main(config: dict[str, Any], job_dir: Path) -> None:
    setup()
    device = torch.device("cuda", 0) if config["gpu"] else torch.device("cpu")
    times: dict[str, list[float]] = {mode: [] for mode in config["modes"]}
    for round_index in range(config["rounds"]):
        order = config["modes"] if round_index % 2 == 0 else config["modes"][::-1]
        for mode in order:
            times[mode].append(fit_once(config, mode, device))
            print(mode, f"{times[mode][-1] * 1e3:.2f} ms/step", flush=True)
    name = torch.cuda.get_device_name(device) if config["gpu"] else "cpu"
    (job_dir / "result.json").write_text(json.dumps({"device": name, "step_times_s": times}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), Path(sys.argv[2]))
