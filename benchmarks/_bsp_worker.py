"""One of the 4 processes of a ``bench_bsp.py`` job: ``python _bsp_worker.py CONFIG_JSON JOB_DIR``.

Trains the digits MLP with ``config["contender"]``; each rank writes ``JOB_DIR/rank<r>.json`` (per epoch:
seconds since training started, val_acc, samples it trained on so far); stacks to the log after ``hang_s``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from harness.worker import quiet_trainer, setup
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_localSGD

from lightning_hier import HierBSPStrategy
from lightning_hier.examples.digits import DigitsClassifier, DigitsDataModule


class PostLocalSGDOnCPU(DDPStrategy):
    """Lightning's ``DDPStrategy`` registers the DDP communication hook on CUDA only (silently: on CPU
    post-local SGD would be plain ``ddp`` plus model averaging). Register it on gloo too, after building
    the gradient subgroups: ``subgroup=None`` would call ``dist.new_subgroups()``, which needs CUDA."""

    def __init__(self, group_size: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.group_size = group_size

    def _register_ddp_hooks(self) -> None:
        state = self._ddp_comm_state
        state.subgroup, _ = dist.new_subgroups(group_size=self.group_size)
        self.model.register_comm_hook(state, self._ddp_comm_hook)


def make_strategy(c: dict[str, Any]) -> Any:
    """The contender's strategy, from the job's config ``c``."""
    if c["contender"] == "hier_bsp":
        steps, seconds = c["superstep_steps"], c["superstep_seconds"]
        return HierBSPStrategy(
            superstep=steps or f"{seconds}s",
            max_staleness=c["max_staleness"],
            fill_idle=c["fill_idle"],
            gradient_average=c["gradient_average"],
            devices_per_node=c.get("devices_per_node") or None,
        )
    if c["contender"] == "ddp":
        return DDPStrategy()
    state = post_localSGD.PostLocalSGDState(None, None, start_localSGD_iter=c["start_local_sgd"])
    hook, period = post_localSGD.post_localSGD_hook, c["averaging_period"]
    return PostLocalSGDOnCPU(
        c["local_sgd_group"], ddp_comm_state=state, ddp_comm_hook=hook, model_averaging_period=period
    )


class Digits(DigitsClassifier):
    """The digits MLP; a ``straggler`` sleeps after each backward as long as its forward and backward took
    (from the start of ``training_step``, so waiting for a model or a collective before it is not
    counted): it computes at half speed, as a device half as fast would."""

    def __init__(self, straggler: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.straggler = straggler

    def training_step(self, *args: Any) -> Any:
        self.compute_start = time.perf_counter()
        return super().training_step(*args)

    def on_after_backward(self) -> None:
        if self.straggler:
            time.sleep(time.perf_counter() - self.compute_start)


class Recorder(pl.Callback):
    """Per epoch: seconds since training started, val_acc, samples so far; stops at the target if asked."""

    def __init__(self, target_acc: float, stop_at_target: bool) -> None:
        self.target_acc, self.stop_at_target = target_acc, stop_at_target
        self.samples = 0
        self.epochs: list[dict[str, float]] = []
        self.batch_ends: list[float] = []  # seconds since training started, per batch of this rank

    def on_train_start(self, *args: Any) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int) -> None:
        self.samples += len(batch[0])
        self.batch_ends.append(time.perf_counter() - self.start)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        acc = float(trainer.callback_metrics["val_acc"])  # synced over the ranks: the same decision on all
        elapsed = time.perf_counter() - self.start
        self.epochs.append({"time_s": elapsed, "val_acc": acc, "samples": self.samples})
        trainer.should_stop = trainer.should_stop or (self.stop_at_target and acc >= self.target_acc)


def main(config: dict[str, Any], job_dir: Path) -> None:
    """Train one contender; write this rank's per-epoch record."""
    rank = int(os.environ["RANK"])
    (job_dir / f"pid.{rank}").write_text(str(os.getpid()))
    faulthandler.dump_traceback_later(config["hang_s"])
    setup()
    pl.seed_everything(config["seed"], verbose=False)
    recorder = Recorder(config["target_acc"], config["stop_at_target"])
    trainer = quiet_trainer(
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=make_strategy(config),
        max_epochs=config["max_epochs"],
        num_sanity_val_steps=0,
        callbacks=[recorder],
    )
    model = Digits(rank == config["straggler"], **{k: config[k] for k in ("hidden", "lr", "momentum")})
    trainer.fit(model, DigitsDataModule(batch_size=config["batch_size"]))
    faulthandler.cancel_dump_traceback_later()
    engine = getattr(trainer.strategy, "engine", None)
    supersteps = [r.to_dict() for r in engine.records] if engine is not None else []
    (job_dir / f"rank{rank}.json").write_text(
        json.dumps({"epochs": recorder.epochs, "supersteps": supersteps, "batch_ends": recorder.batch_ends})
    )


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), Path(sys.argv[2]))
