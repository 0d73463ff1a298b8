"""One ``torch.distributed.run`` job of ``bench_comm_profiler.py``: the same fit with and without
``CommProfiler``, interleaved, per strategy; rank 0 writes ``JOB_DIR/result.json``.

``_comm_profiler_worker.py CONFIG_JSON JOB_DIR``; CONFIG_JSON holds strategies, rounds, hidden,
layers, batch_size, warmup, steps and gpu (one process on CUDA device 0).
"""

from __future__ import annotations

import json
import statistics
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
    (a user's hook: CommProfiler keeps it and reads DDP's timing as under plain ``ddp``); this run's time
    against ``ddp``'s is what a profiler installing such a hook itself would cost."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        trainer.strategy.model.register_comm_hook(None, allreduce_hook)


class CpuMarkedWindow(MarkedWindow):
    """The step window, and the CPU seconds (every thread of every rank) spent per step in it: on an
    oversubscribed 2-core CPU (4 processes) the step time follows the total CPU work, and CPU time is
    far less noisy than wall time."""

    cpu_per_step_s = float("nan")

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if batch_idx == self.first:
            self._cpu_start = time.process_time()
        elif batch_idx == self.first + self.steps:  # every rank reaches it: sum over the ranks
            (spent,) = summed_over_ranks([time.process_time() - self._cpu_start])
            self.cpu_per_step_s = spent / self.steps


def summed_over_ranks(values: list[float]) -> list[float]:
    """``values`` summed over every rank (on the GPU under NCCL: ``ddp`` there builds no CPU backend)."""
    summed = torch.tensor(values, dtype=torch.float64)
    if not dist.is_initialized():
        return values
    if dist.get_backend() == "nccl":
        summed = summed.cuda()
    dist.all_reduce(summed)
    return summed.tolist()


class BlockToggledProfiler(Callback):
    """``--block K``: one fit, ``CommProfiler`` switched on and off every ``K`` steps (all ranks at the same
    step). Off blocks have it truly absent: its wrapping undone (``CommStats.stop``), DDP's timing sample
    rate back at DDP's default, its hooks not called. On and off steps then share the host's drift, which
    separate fits do not: the step time (start to start, rank 0) and CPU seconds (all ranks) per step are
    collected per mode, leaving out the first ``warmup`` steps."""

    reads_gradients = False  # as CommProfiler: hier_sliced keeps its default gradients in hooks

    DDP_DEFAULT_SAMPLE_RATE = 100  # torch's kDDPRuntimeLoggingSampleRate

    def __init__(self, profiler: CommProfiler, block: int, warmup: int, first_on: bool) -> None:
        self.profiler, self.block, self.warmup, self.first_on = profiler, block, warmup, first_on
        self.on = True
        self.on_steps = 0  # the profiler's hooks saw these
        self.step_s: dict[bool, list[float]] = {True: [], False: []}
        self.cpu_s: dict[bool, float] = {True: 0.0, False: 0.0}
        self._last: tuple[float, float, bool, bool] | None = None  # wall, cpu, mode, measured

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.profiler.on_train_start(trainer, pl_module)

    def _switch(self, on: bool) -> None:
        stats, ddp = self.profiler.stats, self.profiler._ddp
        assert stats is not None
        if on:
            stats.start()
        else:
            stats.stop()
        if ddp is not None:
            rate = ddp.timing_every if on else self.DDP_DEFAULT_SAMPLE_RATE
            ddp.model._set_ddp_runtime_logging_sample_rate(rate)
        self.on = on

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter(), time.process_time()
        if self._last is not None and self._last[3]:
            self.step_s[self._last[2]].append(wall - self._last[0])
            self.cpu_s[self._last[2]] += cpu - self._last[1]
        want = ((batch_idx // self.block) % 2 == 0) == self.first_on
        if want != self.on:
            self._switch(want)
        if self.on:
            self.on_steps += 1
            self.profiler.on_train_batch_start(trainer, pl_module, batch, batch_idx)
        # the switch itself is left out (the clock starts after it); the step after it is kept: under
        # hier_pipeline it is the block's one timed step
        self._last = (time.perf_counter(), time.process_time(), self.on, batch_idx >= self.warmup)

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.on:
            self.profiler.on_after_backward(trainer, pl_module)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.on:
            self.profiler.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.profiler._stop()

    def result(self) -> tuple[float, float, float, float]:
        """Median step time without and with, and CPU seconds per step (all ranks) without and with."""
        stats = self.profiler.stats
        if stats is None or len(stats.steps) != self.on_steps:  # the profiler missed a step it was on for
            accounted = stats and len(stats.steps)
            raise RuntimeError(f"CommProfiler accounted {accounted} steps of {self.on_steps}")
        cpu = summed_over_ranks([self.cpu_s[False], self.cpu_s[True]])
        off, on = self.step_s[False], self.step_s[True]
        cpu_off, cpu_on = cpu[0] / len(off), cpu[1] / len(on)
        return statistics.median(off), statistics.median(on), cpu_off, cpu_on


def make_strategy(name: str, devices_per_node: int) -> Any:
    """The contender ``name``: Lightning's ``ddp`` (also under ``ddp_python_hook``) or one of ours."""
    if name == "hier_sliced":
        return HierSlicedStrategy(devices_per_node=devices_per_node)
    if name == "hier_bsp":  # plain BSP: one superstep per step, never stale
        return HierBSPStrategy(devices_per_node=devices_per_node, superstep=1, max_staleness=0)
    if name == "hier_pipeline":  # one stage per process, the split fixed (nothing timed)
        return HierPipelineStrategy(partition="uniform", rebalance="never", micro_batches=4)
    return "ddp"


def make_profiler(config: dict[str, Any]) -> CommProfiler:
    """The profiler under test, writing to a temporary directory (no figure, no table printed)."""
    every = config.get("time_every") or None  # 0: the callback's default
    out = tempfile.mkdtemp(prefix="lhbench-commprof-")
    return CommProfiler(output_dir=out, save_figure=False, print_summary=False, time_every_n_steps=every)


def fit(config: dict[str, Any], strategy: str, steps: int, callbacks: list[Any]) -> None:
    """``steps`` steps of the harness MLP under ``strategy`` (seeded: every fit sees the same data)."""
    torch.manual_seed(0)
    hidden, batch = config["hidden"], config["batch_size"]
    data = TensorDataset(torch.randn(steps * batch * 4, hidden), torch.randn(steps * batch * 4, hidden))
    if strategy == "ddp_python_hook":
        callbacks = [*callbacks, PythonAllReduceHook()]
    gpu = config.get("gpu", False)
    chosen = make_strategy(strategy, devices_per_node=1 if gpu else 2)
    trainer = quiet_trainer(
        accelerator="gpu" if gpu else "cpu", devices=1 if gpu else 4, strategy=chosen, max_steps=steps,
        callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(MLP(hidden, config["layers"], 1e-3), DataLoader(data, batch_size=batch))


def fit_once(config: dict[str, Any], strategy: str, profiled: bool) -> tuple[float, float]:
    """Median step time of the measured window of one fit, and the CPU seconds per step (all ranks)."""
    window = CpuMarkedWindow(config["warmup"], config["steps"], signal_dir=None)
    callbacks: list[Any] = [window] + ([make_profiler(config)] if profiled else [])
    fit(config, strategy, config["warmup"] + config["steps"] + 1, callbacks)
    return window.summary()["median_step_s"], window.cpu_per_step_s


def fit_blocks(config: dict[str, Any], strategy: str, first_on: bool) -> tuple[float, float, float, float]:
    """One fit with the profiler on and off in alternate blocks (:class:`BlockToggledProfiler`)."""
    toggled = BlockToggledProfiler(make_profiler(config), config["block"], config["warmup"], first_on)
    fit(config, strategy, config["warmup"] + config["steps"] + 1, [toggled])
    return toggled.result()


def run_rounds(config: dict[str, Any], strategy: str) -> dict[str, list[float]]:
    """Per round: the median step time and CPU per step, without and with the profiler."""
    times: dict[str, list[float]] = {"without": [], "with": [], "cpu_without": [], "cpu_with": []}
    for round_index in range(config["rounds"]):
        first = round_index % 2 == 0  # alternate who goes first
        if config.get("block"):
            measured = fit_blocks(config, strategy, first_on=first)  # without, with, and their CPU
            for key, value in zip(("without", "with", "cpu_without", "cpu_with"), measured):
                times[key].append(value)
            continue
        for profiled in (not first, first):
            step_s, cpu_s = fit_once(config, strategy, profiled)
            times["with" if profiled else "without"].append(step_s)
            times["cpu_with" if profiled else "cpu_without"].append(cpu_s)
    return times


def main(config: dict[str, Any], job_dir: Path) -> None:
    setup()
    results: dict[str, dict[str, list[float]]] = {}
    for strategy in config["strategies"]:
        results[strategy] = run_rounds(config, strategy)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    (job_dir / "result.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), Path(sys.argv[2]))
