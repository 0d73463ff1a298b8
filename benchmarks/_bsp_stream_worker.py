"""One ``torch.distributed.run`` job of ``bench_bsp_stream.py`` (one process, CUDA device 0): the same
fit under ``ddp``, under ``hier_bsp`` with the local BSP module on its own stream (the product), and
under ``hier_bsp`` with the module forced onto the worker's stream (without ``StreamHandoff``: every push,
server step and pull queued behind the worker's kernels, a device-wide synchronize per superstep); rank 0
writes ``JOB_DIR/result.json``.

``_bsp_stream_worker.py CONFIG_JSON JOB_DIR``; CONFIG_JSON holds modes, rounds, hidden, layers,
batch_size, warmup, steps, max_staleness.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from harness.worker import MLP, quiet_trainer, setup
from lightning import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import HierBSPStrategy
from lightning_hier.bsp.stream_handoff import StreamHandoff


class AdamMLP(MLP):
    """The harness MLP with Adam: the server's step is real device work (two moments per parameter)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class Window(Callback):
    """Wall time of steps ``[first, first + steps)``, the device synchronized at the two edges only (a
    synchronize per step would stop the module's stream from overlapping the next step)."""

    def __init__(self, first: int, steps: int) -> None:
        self.first, self.steps, self.edges = first, steps, []

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, idx: int
    ) -> None:
        if idx in (self.first, self.first + self.steps):
            torch.cuda.synchronize()
            self.edges.append(time.perf_counter())


def on_worker_stream() -> contextlib.AbstractContextManager:
    """The module issues on the calling thread's current stream (the default one) and waits for the whole
    device before reading a clock: the behaviour without ``StreamHandoff``."""
    return mock.patch.multiple(
        StreamHandoff,
        module_stream=lambda self: contextlib.nullcontext(),
        module_synchronize=lambda self: torch.cuda.synchronize(self.device),
    )


def fit_once(config: dict[str, Any], mode: str) -> float:
    """Mean step time of the measured window of one fit."""
    torch.manual_seed(0)
    hidden, batch = config["hidden"], config["batch_size"]
    steps = config["warmup"] + config["steps"] + 1
    data = TensorDataset(torch.randn(steps * batch, hidden), torch.randn(steps * batch, hidden))
    window = Window(config["warmup"], config["steps"])
    strategy: Any = (
        "ddp" if mode == "ddp"
        else HierBSPStrategy(superstep=1, max_staleness=config["max_staleness"], devices_per_node=1)
    )  # fmt: skip
    patch = on_worker_stream() if mode == "bsp_worker_stream" else contextlib.nullcontext()
    with patch:
        # one epoch of exactly ``steps`` batches (with max_staleness > 0 hier_bsp takes epochs, not steps)
        trainer = quiet_trainer(accelerator="gpu", devices=1, strategy=strategy, max_epochs=1,
                                callbacks=[window])  # fmt: skip
        trainer.fit(AdamMLP(hidden, config["layers"], 1e-4), DataLoader(data, batch_size=batch))
    return (window.edges[1] - window.edges[0]) / config["steps"]


def main(config: dict[str, Any], job_dir: Path) -> None:
    setup()
    times: dict[str, list[float]] = {mode: [] for mode in config["modes"]}
    for round_index in range(config["rounds"]):
        order = config["modes"] if round_index % 2 == 0 else config["modes"][::-1]
        for mode in order:
            times[mode].append(fit_once(config, mode))
            print(mode, f"{times[mode][-1] * 1e3:.2f} ms/step", flush=True)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    (job_dir / "result.json").write_text(json.dumps(times))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), Path(sys.argv[2]))
