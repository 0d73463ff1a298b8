"""``GradientTimingProfiler``: see when gradients become ready and how much communication hides.

Add it to the Trainer's callbacks with ``strategy="hier_sliced"`` (most useful with
``bucketing="time"``). It

- logs, every ``log_every_n_steps`` optimizer steps, the backward time, the fraction of
  communication that ran while backward was still running (``grad_sync/hidden_fraction``), the
  exposed communication after backward, and for the first ``max_logged_buckets`` buckets their
  size, send time and completion time (milliseconds after backward started);
- writes ``time_plan.json`` (time points, bucket membership, bytes) each time a plan is made;
- draws ``gradient_timeline.png`` in the log directory: every gradient's ready time, the plan's
  time points and each bucket's communication span, after each new plan and at the end of training;
- with ``reprofile_every_n_epochs=N``, asks for a fresh profile every ``N`` epochs.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_hier.bucketing.time_bucketing import StepTimeline
from lightning_hier.bucketing.time_plan import TimePlan
from lightning_hier.checks import check_flag, check_integer, check_path

log = logging.getLogger(__name__)


class GradientTimingProfiler(Callback):
    """Logs gradient-ready timing and communication overlap of ``hier_sliced``; draws a timeline.

    Args:
        reprofile_every_n_epochs: ask the strategy for a fresh profile (and a new time plan) every this many
            epochs; ``None``: only the strategy's own re-profiling.
        log_every_n_steps: log the timing metrics every this many optimizer steps.
        max_logged_buckets: log size, send time and completion time of this many buckets at most.
        save_figure: draw ``gradient_timeline.png`` after each new plan and at the end of training (rank 0).
        output_dir: where ``time_plan.json`` and the figure go; ``None``: the logger's directory, else the
            Trainer's ``default_root_dir``.
    """

    def __init__(
        self,
        reprofile_every_n_epochs: int | None = None,
        log_every_n_steps: int = 10,
        max_logged_buckets: int = 8,
        save_figure: bool = True,
        output_dir: str | None = None,
    ) -> None:
        check_integer("reprofile_every_n_epochs", reprofile_every_n_epochs, 1, allow_none=True)
        check_integer("log_every_n_steps", log_every_n_steps, 1)
        check_integer("max_logged_buckets", max_logged_buckets, 0)
        check_flag("save_figure", save_figure)
        check_path("output_dir", output_dir)
        self.reprofile_every_n_epochs = reprofile_every_n_epochs
        self.log_every_n_steps = log_every_n_steps
        self.max_logged_buckets = max_logged_buckets
        self.save_figure = save_figure
        self.output_dir = output_dir
        self._plans_seen = 0
        self.hidden_fractions: list[float] = []

    @staticmethod
    def _engine(trainer: pl.Trainer) -> Any:
        return getattr(trainer.strategy, "engine", None)

    def _directory(self, trainer: pl.Trainer) -> Path:
        # not trainer.log_dir: it broadcasts (a collective) and this runs on rank 0 only
        logger_dir = trainer.logger.log_dir if trainer.logger is not None else None
        base = self.output_dir or logger_dir or trainer.default_root_dir
        path = Path(base)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lightning_hier.strategies.hier_sliced import HierSlicedStrategy

        if stage == "fit" and not isinstance(trainer.strategy, HierSlicedStrategy):
            raise ValueError(
                f"GradientTimingProfiler needs strategy='hier_sliced', got {type(trainer.strategy).__name__}."
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the timeline's gradient-ready times, which hier_sliced takes only where they are read
        for engine in getattr(trainer.strategy, "engines", ()):
            engine.record_ready_times = True

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        engine = self._engine(trainer)
        if engine is None or engine.last_timeline is None:
            return
        timeline: StepTimeline = engine.last_timeline
        self.hidden_fractions.append(timeline.hidden_fraction())
        if trainer.global_step % self.log_every_n_steps == 0:
            self._log_timeline(pl_module, timeline)
        timing = engine.time_bucketing
        if timing is not None and timing.plan is not None and timing.plans_made != self._plans_seen:
            self._plans_seen = timing.plans_made
            self._on_new_plan(trainer, timing.plan, timeline)

    def _log_timeline(self, pl_module: pl.LightningModule, timeline: StepTimeline) -> None:
        metrics = {
            "grad_sync/hidden_fraction": timeline.hidden_fraction(),
            "grad_sync/backward_ms": timeline.backward_seconds * 1e3,
            "grad_sync/exposed_ms": max(
                0.0, max(timeline.bucket_done, default=0.0) - timeline.backward_seconds
            )
            * 1e3,
            "grad_sync/num_buckets": float(len(timeline.bucket_bytes)),
        }
        for i, (size, launch, done) in enumerate(
            zip(timeline.bucket_bytes, timeline.bucket_launch, timeline.bucket_done)
        ):
            if i >= self.max_logged_buckets:
                break
            metrics[f"grad_sync/bucket{i}_mb"] = size / 2**20
            metrics[f"grad_sync/bucket{i}_send_ms"] = launch * 1e3
            metrics[f"grad_sync/bucket{i}_done_ms"] = done * 1e3
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)

    def _on_new_plan(self, trainer: pl.Trainer, plan: TimePlan, timeline: StepTimeline) -> None:
        if not trainer.is_global_zero:
            return
        log.info("hier_sliced time plan #%d: %s", self._plans_seen, plan.describe())
        directory = self._directory(trainer)
        (directory / "time_plan.json").write_text(
            json.dumps({"plan": self._plans_seen, **plan.to_dict()}, indent=2)
        )

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = self._engine(trainer)
        n = self.reprofile_every_n_epochs
        if (
            n
            and engine is not None
            and engine.time_bucketing is not None
            and (trainer.current_epoch + 1) % n == 0
        ):
            engine.time_bucketing.request_reprofile()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = self._engine(trainer)
        if not (self.save_figure and trainer.is_global_zero and engine is not None and engine.last_timeline):
            return
        plan = engine.time_bucketing.plan if engine.time_bucketing is not None else None
        try:
            draw_timeline(engine.last_timeline, plan, self._directory(trainer) / "gradient_timeline.png")
        except ImportError:
            log.warning("GradientTimingProfiler: install matplotlib to get gradient_timeline.png")


def draw_timeline(timeline: StepTimeline, plan: TimePlan | None, path: Path) -> Path:
    """Draw gradient-ready times, the plan's time points and per-bucket communication spans."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ready = [(t * 1e3, i) for i, t in enumerate(timeline.ready) if t is not None]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, height_ratios=[2, 1])
    if ready:
        top.scatter([t for t, _ in ready], [i for _, i in ready], s=8, label="gradient ready")
    top.axvline(timeline.backward_seconds * 1e3, color="k", linestyle="--", label="end of backward")
    for point in plan.time_points if plan is not None else ():
        top.axvline(point * 1e3, color="tab:red", alpha=0.5)
    if plan is not None:
        top.plot([], [], color="tab:red", alpha=0.5, label="time points")
    top.set_ylabel("parameter index")
    top.legend(loc="upper left", fontsize="small")
    for i, (launch, done) in enumerate(zip(timeline.bucket_launch, timeline.bucket_done)):
        bottom.barh(i, (done - launch) * 1e3, left=launch * 1e3, color="tab:blue")
    bottom.axvline(timeline.backward_seconds * 1e3, color="k", linestyle="--")
    bottom.set_ylabel("bucket")
    bottom.set_xlabel("ms after backward started")
    bottom.set_title(f"communication per bucket (hidden behind backward: {timeline.hidden_fraction():.0%})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
