"""``CommProfiler``: bytes, collectives, time and hidden time per training step and per link kind.

``Trainer(callbacks=[CommProfiler()])`` with ``hier_sliced``, ``hier_pipeline``, ``hier_bsp`` or
Lightning's ``ddp``. While training runs (``on_train_start`` to ``on_train_end``) it wraps the
``torch.distributed`` functions (:class:`lightning_hier.profiling.CommStats`; nothing is wrapped when
the callback is absent, and everything is unwrapped at the end, at teardown and on exceptions), and

- logs per step and kind ``comm/<kind>/bytes``, ``count``, ``time_ms``, ``exposed_ms``,
  ``hidden_ms`` and ``comm/step_ms``, ``comm/compute_ms``, ``comm/exposed_ms`` to the Trainer's
  loggers every ``log_every_n_steps`` steps (rank 0's values; with ``time_every_n_steps=n`` the times
  only for the timed steps ``0, n, 2n, ...``, bytes and counts for every step);
- writes ``comm_profile.csv`` (every rank's rows, gathered at the end of training) into the log
  directory, prints a summary table and saves ``comm_profile.png`` there (rank 0).

Kinds: ``intra`` / ``inter`` (the strategy's :class:`~lightning_hier.topology.Topology` groups),
``p2p`` (pipeline sends and receives), ``ps_push`` / ``ps_pull`` (``hier_bsp``'s parameter server),
``world`` (all-rank groups, Lightning's ``ddp`` gradient buckets) and ``other``. Under ``ddp`` the
gradient all-reduce happens in DDP's C++ reducer, out of Python's sight: the callback reads DDP's own
timing of its buckets after each synchronising backward
(:class:`~lightning_hier.profiling.ddp_reducer.DDPReducerStats`) and adds it to the step's ``world``
kind, leaving DDP's reducer (and a user's comm hook) as they are.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_hier.checks import check_flag, check_integer, check_path
from lightning_hier.profiling.comm_stats import PS, CommStats, KindStats, StepStats
from lightning_hier.profiling.ddp_reducer import DDPReducerStats
from lightning_hier.profiling.report import save_figure, step_rows, summary_table, write_csv

log = logging.getLogger(__name__)

PIPELINE_TIME_EVERY = 10  # time_every_n_steps=None under hier_pipeline (benchmarks/README.md)


class CommProfiler(Callback):
    """Measures every rank's communication per training step and link kind; logs, tabulates, draws it.

    Args:
        log_every_n_steps: log to the Trainer's loggers every N training steps (default: the
            Trainer's ``log_every_n_steps``).
        output_dir: where the CSV and figure go (default: the first logger's ``log_dir``, else the
            Trainer's ``default_root_dir``).
        filename: stem of the CSV and PNG files.
        save_figure: draw the PNG (matplotlib, Agg backend).
        print_summary: print the table at the end of training (rank 0).
        ddp_timing_every: under Lightning's ``ddp``, time DDP's all-reduces every N synchronising steps
            (``None``: every step on CPU, every 20th on CUDA, where each timed step makes the host wait
            for the device; steps in between carry the latest timing, counts and bytes stay exact).
        time_every_n_steps: time the operations of every N-th training step only (steps 0, N, 2N, ...);
            the others count operations and bytes, which costs a few dictionary updates per operation
            instead of clock stamps and completion tracking. ``None`` (default): every 10th step under
            ``hier_pipeline``, whose every message passes the profiler (dozens of small sends per step, a
            latency-bound link: timing each cost ~6-9 % of the step on a 2-core CPU, every 10th ~2 %),
            every step otherwise. The CSV marks the timed steps (``timed``); the table and the figure take
            times from them, bytes and counts from every step.
    """

    reads_gradients = False  # its on_after_backward reads DDP's sync flag, not .grad (hier_sliced's "auto")

    # its on_after_backward reads the clock only: hier_bsp keeps pushing buckets during backward with it
    leaves_gradients_alone = True

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        output_dir: str | None = None,
        filename: str = "comm_profile",
        save_figure: bool = True,
        print_summary: bool = True,
        ddp_timing_every: int | None = None,
        time_every_n_steps: int | None = None,
    ) -> None:
        for name, every in [("log_every_n_steps", log_every_n_steps), ("ddp_timing_every", ddp_timing_every),
                            ("time_every_n_steps", time_every_n_steps)]:  # fmt: skip
            check_integer(name, every, 1, allow_none=True)
        if not isinstance(filename, str) or not filename or "/" in filename or os.sep in filename:
            raise ValueError(f"filename must be a file stem (directories: output_dir), got {filename!r}.")
        check_path("output_dir", output_dir)
        check_flag("save_figure", save_figure)
        check_flag("print_summary", print_summary)
        self.time_every_n_steps = time_every_n_steps
        self.ddp_timing_every = ddp_timing_every
        self.log_every_n_steps = log_every_n_steps
        self.output_dir = output_dir
        self.filename = filename
        self.save_figure = save_figure
        self.print_summary = print_summary
        self.stats: CommStats | None = None
        self.rows: list[dict[str, Any]] = []  # every rank's, on rank 0 after training
        self.csv_path: Path | None = None
        self.figure_path: Path | None = None
        self.summary: str = ""
        self._batches = 0
        self._global_steps: dict[int, int] = {}  # per training batch not yet logged: the Trainer's step
        self._ddp: DDPReducerStats | None = None
        self._ddp_synced = False  # the running batch's backward reduced (not an accumulating one)
        self._ddp_steps: dict[int, KindStats] = {}  # per batch: DDP's buckets, until its step is accounted

    # ------------------------------------------------------------------ start
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop()
        stats = CommStats(self._time_every(trainer.strategy))
        self._register_groups(stats, trainer.strategy)
        self._ddp, self._ddp_steps = DDPReducerStats.attach(trainer.strategy, self.ddp_timing_every), {}
        self.stats, self.rows, self._batches, self._global_steps = stats, [], 0, {}
        stats.start()

    def _time_every(self, strategy: Any) -> int:
        from lightning_hier.strategies.hier_pipeline import HierPipelineStrategy

        if self.time_every_n_steps is not None:
            return self.time_every_n_steps
        return PIPELINE_TIME_EVERY if isinstance(strategy, HierPipelineStrategy) else 1

    @staticmethod
    def _register_groups(stats: CommStats, strategy: Any) -> None:
        from lightning_hier.strategies.hier_bsp import HierBSPStrategy
        from lightning_hier.strategies.hier_pipeline import HierPipelineStrategy
        from lightning_hier.strategies.hier_sliced import HierSlicedStrategy

        engine = getattr(strategy, "engine", None)
        if isinstance(strategy, HierSlicedStrategy) and strategy.topology is not None:
            topology = strategy.topology
            stats.register_group(topology.world_group, "world")
            stats.register_group(topology.intra_group, "intra")
            stats.register_group(topology.inter_group, "inter")
            for sliced_engine in strategy.engines:  # the main thread waits there for the reducers
                stats.watch(sliced_engine, "finish_backward")
        elif isinstance(strategy, HierBSPStrategy) and engine is not None:
            stats.register_group(engine.topology.world_group, "world")  # the BSP thread's ticks
            stats.register_group(engine.topology.intra_group, PS)
            stats.register_group(engine.topology.inter_group, PS)
            # a worker waiting for the server's model; watched on the class, so that an engine rebuilt on a
            # time plan (bucketing="time") mid-batch is covered from its first wait on
            stats.watch(type(engine.memory), "wait")
        elif isinstance(strategy, HierPipelineStrategy) and engine is not None:
            stats.register_group(engine.group, "world")  # sends and receives on it are "p2p"

    # ------------------------------------------------------------------ per step
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.stats is not None:
            self.stats.begin_step(self._batches)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._ddp is not None:
            self._ddp_synced = self._ddp_synced or self._ddp.synchronizing

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.stats is None:
            return
        if self._ddp is not None and self._ddp_synced:
            self._ddp_steps[self._batches] = self._ddp.read()
        self._ddp_synced = False
        self._global_steps[self._batches] = trainer.global_step
        self._batches += 1
        self._log(trainer, self.stats.end_step())  # on CUDA: the steps the device has finished by now

    def _log(self, trainer: pl.Trainer, steps: list[StepStats]) -> None:
        every = self.log_every_n_steps or trainer.log_every_n_steps or 1
        for step in steps:
            self._add_ddp_buckets(step)
            global_step = self._global_steps.pop(step.index, trainer.global_step)
            if (step.index + 1) % every == 0 and trainer.loggers:
                metrics = _metrics(step)
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=global_step)

    def _add_ddp_buckets(self, step: StepStats) -> None:
        """DDP's gradient all-reduces of this step, into its ``world`` kind (exposed: blocked on them)."""
        buckets = self._ddp_steps.pop(step.index, None)
        if buckets is None:
            return
        if not step.timed:  # counts and bytes only, as for the step's other operations
            buckets = KindStats(buckets.count, buckets.nbytes, buckets.wire_bytes)
        step.kinds.setdefault("world", KindStats()).add(buckets)
        step.exposed_s += buckets.exposed_s

    # ------------------------------------------------------------------ end
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stats = self.stats
        if stats is None:
            return
        accounted = len(stats.steps)
        self._stop()  # accounts the steps still waiting for the device
        self._log(trainer, stats.steps[accounted:])
        rank = trainer.global_rank
        mine = step_rows(stats.steps, rank)
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            from lightning_hier.topology import control_group

            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine, group=control_group())
            rows = [row for part in gathered for row in part]
        else:
            rows = mine
        if rank != 0:
            return
        self.rows = rows
        directory = self._directory(trainer)
        self.csv_path = write_csv(rows, directory / f"{self.filename}.csv")
        self.summary = summary_table(rows)
        if self.print_summary:
            print(self.summary, flush=True)
        if self.save_figure:
            self.figure_path = save_figure(rows, directory / f"{self.filename}.png")

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._stop()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.stats is not None:
            self.stats.stop()

    def _directory(self, trainer: pl.Trainer) -> Path:
        # not trainer.log_dir: it broadcasts (a collective) and this runs on rank 0 only
        logger_dir = getattr(trainer.logger, "log_dir", None) if trainer.logger is not None else None
        path = Path(self.output_dir or logger_dir or trainer.default_root_dir)
        path.mkdir(parents=True, exist_ok=True)
        return path


def _metrics(step: StepStats) -> dict[str, float]:
    metrics = {"comm/step_ms": step.step_s * 1e3}
    if step.timed:
        metrics["comm/compute_ms"] = step.compute_s * 1e3
        metrics["comm/exposed_ms"] = step.exposed_s * 1e3
    for kind, stats in step.kinds.items():
        metrics[f"comm/{kind}/bytes"] = float(stats.nbytes)
        metrics[f"comm/{kind}/count"] = float(stats.count)
        if not step.timed:
            continue
        metrics[f"comm/{kind}/time_ms"] = stats.time_s * 1e3
        metrics[f"comm/{kind}/exposed_ms"] = stats.exposed_s * 1e3
        metrics[f"comm/{kind}/hidden_ms"] = stats.hidden_s * 1e3
    return metrics
