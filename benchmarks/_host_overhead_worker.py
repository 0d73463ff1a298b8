"""One ``torch.distributed.run`` job of ``bench_host_overhead.py`` (one process): the same fit under each
strategy, interleaved over rounds; rank 0 writes ``JOB_DIR/result.json``.

``_host_overhead_worker.py CONFIG_JSON JOB_DIR``; CONFIG_JSON holds strategies, rounds, hidden, layers,
batch_size, warmup, steps and gpu.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from harness.worker import MLP, quiet_trainer, setup
from lightning import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import HierBSPStrategy, HierPipelineStrategy, HierSlicedStrategy


class StepWindow(Callback):
    """Per step of the measured window: wall time (the device synchronised at each step's start, outside
    the strategy) and the main thread's CPU time; on CUDA the synchronising operations in between."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.step_s: list[float] = []
        self.cpu_s: list[float] = []
        self.syncs = 0
        self._last: tuple[float, float] | None = None

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            torch.cuda.set_sync_debug_mode(0)  # our own synchronize below is not the strategy's
            torch.cuda.synchronize()
        now = (time.perf_counter(), time.thread_time())
        if self._last is not None and batch_idx > self.first:
            self.step_s.append(now[0] - self._last[0])
            self.cpu_s.append(now[1] - self._last[1])
        self._last = now
        if cuda and batch_idx >= self.first:
            torch.cuda.set_sync_debug_mode("warn")

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)


def make_strategy(name: str) -> Any:
    if name == "hier_sliced":
        return HierSlicedStrategy(devices_per_node=1)
    if name == "hier_bsp":  # plain BSP: one superstep per step, never stale
        return HierBSPStrategy(devices_per_node=1, superstep=1, max_staleness=0)
    if name == "hier_pipeline":  # one stage, the whole batch as one micro-batch
        return HierPipelineStrategy(micro_batches=1, rebalance="never")
    return "ddp"


def fit_once(config: dict[str, Any], name: str) -> dict[str, float]:
    """The median step, main-thread CPU per step and synchronisations per step of one fit."""
    torch.manual_seed(0)
    steps = config["warmup"] + config["steps"] + 1
    samples = steps * config["batch_size"]
    data = TensorDataset(torch.randn(samples, config["hidden"]), torch.randn(samples, config["hidden"]))
    window = StepWindow(config["warmup"])
    trainer = quiet_trainer(
        accelerator="gpu" if config["gpu"] else "cpu", devices=1, strategy=make_strategy(name),
        max_steps=steps, callbacks=[window],
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(
            MLP(config["hidden"], config["layers"], 1e-4), DataLoader(data, batch_size=config["batch_size"])
        )
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return {
        "step_s": statistics.median(window.step_s),
        "cpu_s": statistics.median(window.cpu_s),
        "syncs_per_step": syncs / max(1, len(window.step_s) + 1),
    }


def main(config: dict[str, Any], job_dir: Path) -> None:
    setup()
    runs: dict[str, dict[str, list[float]]] = {}
    for round_index in range(config["rounds"]):
        order = config["strategies"] if round_index % 2 == 0 else config["strategies"][::-1]
        for name in order:
            measured = fit_once(config, name)
            for key, value in measured.items():
                runs.setdefault(name, {}).setdefault(key, []).append(value)
            print(name, f"{measured['step_s'] * 1e3:.2f} ms/step", flush=True)
    device = torch.cuda.get_device_name(0) if config["gpu"] else "cpu"
    runs = {name: {"step_s": r["step_s"], "cpu_s": r["cpu_s"], "syncs_per_step": r["syncs_per_step"]}
            for name, r in runs.items()}  # fmt: skip
    (job_dir / "result.json").write_text(json.dumps({"device": device, "runs": runs}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), Path(sys.argv[2]))
