"""One ``torch.distributed.run`` job of ``bench_comm_profiler.py``: the same fit with and without
``CommProfiler``, interleaved, per strategy; rank 0 writes ``JOB_DIR/result.json``.

``_comm_profiler_worker.py CONFIG_JSON JOB_DIR``; CONFIG_JSON holds strategies, rounds, hidden,
layers, batch_size, warmup, steps and gpu (one process on CUDA device 0).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from harness.worker import MLP, MarkedWindow, quiet_trainer, setup
from lightning import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import CommProfiler, HierBSPStrategy, HierPipelineStrategy, HierSlicedStrategy


class PythonAllReduceHook(Callback):
    """``ddp_python_hook``: DDP's buckets all-reduced through torch's own Python comm hook in both runs
    (a user's hook: CommProfiler keeps it and reads DDP's timing as under plain ``ddp``); until
    2026-11-26 the profiler installed this hook itself, so this run's time against ``ddp``'s is what
    that cost."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        trainer.strategy.model.register_comm_hook(None, allreduce_hook)


class CpuMarkedWindow(MarkedWindow):
    """The step window, and the CPU seconds (every thread of every rank) spent per step in it: on this
    oversubscribed host (4 processes, 2 cores) the step time follows the total CPU work, and CPU time is
    far less noisy than wall time."""

    cpu_per_step_s = float("nan")

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if batch_idx == self.first:
            self._cpu_start = time.process_time()
        elif batch_idx == self.first + self.steps:  # every rank reaches it: sum over the ranks
            spent = torch.tensor([time.process_time() - self._cpu_start], dtype=torch.float64)
            if dist.is_initialized():
                dist.all_reduce(spent)
            self.cpu_per_step_s = float(spent) / self.steps


def make_strategy(name: str, devices_per_node: int) -> Any:
    """The contender ``name``: Lightning's ``ddp`` (also under ``ddp_python_hook``) or one of ours."""
    if name == "hier_sliced":
        return HierSlicedStrategy(devices_per_node=devices_per_node)
    if name == "hier_bsp":  # plain BSP: one superstep per step, never stale
        return HierBSPStrategy(devices_per_node=devices_per_node, superstep_steps=1, max_staleness=0)
    if name == "hier_pipeline":  # one stage per process, the split fixed (nothing timed)
        return HierPipelineStrategy(partition="uniform", rebalance="never", micro_batches=4)
    return "ddp"


def fit_once(config: dict[str, Any], strategy: str, profiled: bool) -> tuple[float, float]:
    """Median step time of the measured window of one fit, and the CPU seconds per step (all ranks)."""
    torch.manual_seed(0)
    hidden, batch = config["hidden"], config["batch_size"]
    steps = config["warmup"] + config["steps"] + 1
    data = TensorDataset(torch.randn(steps * batch * 4, hidden), torch.randn(steps * batch * 4, hidden))
    window = CpuMarkedWindow(config["warmup"], config["steps"], signal_dir=None)
    callbacks: list[Any] = [window]
    if strategy == "ddp_python_hook":
        callbacks.append(PythonAllReduceHook())
    if profiled:
        out = tempfile.mkdtemp(prefix="lhbench-commprof-")
        every = config.get("time_every") or None  # 0: the callback's default
        callbacks.append(
            CommProfiler(output_dir=out, save_figure=False, print_summary=False, time_every_n_steps=every)
        )
    gpu = config.get("gpu", False)
    chosen = make_strategy(strategy, devices_per_node=1 if gpu else 2)
    trainer = quiet_trainer(
        accelerator="gpu" if gpu else "cpu", devices=1 if gpu else 4, strategy=chosen, max_steps=steps,
        callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(MLP(hidden, config["layers"], 1e-3), DataLoader(data, batch_size=batch))
    return window.summary()["median_step_s"], window.cpu_per_step_s


def main(config: dict[str, Any], job_dir: Path) -> None:
    setup()
    results: dict[str, dict[str, list[float]]] = {}
    for strategy in config["strategies"]:
        times: dict[str, list[float]] = {"without": [], "with": [], "cpu_without": [], "cpu_with": []}
        for round_index in range(config["rounds"]):
            order = (False, True) if round_index % 2 == 0 else (True, False)  # alternate who goes first
            for profiled in order:
                step_s, cpu_s = fit_once(config, strategy, profiled)
                times["with" if profiled else "without"].append(step_s)
                times["cpu_with" if profiled else "cpu_without"].append(cpu_s)
        results[strategy] = times
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    (job_dir / "result.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), Path(sys.argv[2]))
