"""One ``torch.distributed.run`` job of ``bench_pipeline_warmup.py``: ``hier_pipeline`` on a fixed split of
the benchmark's stack, switching the extra 1F1B warm-up forwards between 0 and ``extra`` every ``block``
steps on every rank; rank 0 writes ``JOB_DIR/result.json`` with the step times of each setting.

``_pipeline_warmup_worker.py CONFIG_JSON JOB_DIR``; CONFIG_JSON holds partition, model, batch_size,
micro_batches, static_shapes, steps, warmup, block and extra.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from _pipeline_worker import HIDDENS, MODELS, make_batches, skewed_mlp
from harness.worker import quiet_trainer, setup
from lightning import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader

from lightning_hier import HierPipelineStrategy


class Alternate(Callback):
    """Before each step: the setting of its block (0 or ``extra``, every ``block`` steps, the same on every
    rank since every rank counts the same batches), and on rank 0 the step's start time."""

    def __init__(self, extra: int, block: int) -> None:
        self.extra, self.block = extra, block
        self.starts: list[tuple[float, int]] = []

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, idx: int
    ) -> None:
        setting = self.extra if (idx // self.block) % 2 else 0
        engine = trainer.strategy.engine  # type: ignore[attr-defined]
        engine.schedule.extra_warmup = [setting] * (engine.num_stages - 1)
        self.starts.append((time.perf_counter(), setting))


def main() -> None:
    c, job_dir = json.loads(sys.argv[1]), Path(sys.argv[2])
    setup()
    core = int(os.environ["LOCAL_RANK"]) % (os.cpu_count() or 1)  # one core per stage, as bench_pipeline
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {core})
    HIDDENS[:] = MODELS[c["model"]]
    strategy = HierPipelineStrategy(
        micro_batches=c["micro_batches"],
        partition=c["partition"],
        rebalance="never",
        static_shapes=c["static_shapes"],
    )
    strategy._extra_warmup = 0  # a tuning attribute; Alternate sets the engine's counts per block of steps
    alternate = Alternate(c["extra"], c["block"])
    steps = c["warmup"] + c["steps"] + 1
    model, batches = skewed_mlp(), make_batches(c["batch_size"])
    data = DataLoader([batches[i % len(batches)] for i in range(steps)], batch_size=None)
    world = int(os.environ["WORLD_SIZE"])
    trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=steps, callbacks=[alternate])
    trainer.fit(model, data)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    times: dict[str, list[float]] = {"0": [], str(c["extra"]): []}
    starts = alternate.starts[c["warmup"] :]
    for (start, setting), (end, next_setting) in zip(starts, starts[1:]):
        if setting == next_setting:  # a step whose successor ran the same setting: no switch inside
            times[str(setting)].append(end - start)
    (job_dir / "result.json").write_text(json.dumps({"step_times_s": times}))


if __name__ == "__main__":
    main()
