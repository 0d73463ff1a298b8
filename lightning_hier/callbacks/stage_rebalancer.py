"""``StageRebalancer``: watch and plot ``hier_pipeline``'s rebalancing.

Add it to the Trainer's callbacks with ``strategy="hier_pipeline"``. It only reports; the rebalancing is
configured on the strategy (``rebalance``, ``memory_limit``, ...). It

- logs at each rebalance check ``pipeline/stage_time_<s>`` (ms per micro-batch),
  ``pipeline/imbalance`` and, when the split changed, ``pipeline/migrated_layers``,
  ``pipeline/migrated_bytes`` and ``pipeline/migration_pause_s``;
- logs ``pipeline/swap_layers`` and ``pipeline/recompute_layers`` whenever the stages decide
  their memory plans (with ``memory_limit``);
- writes ``pipeline_rebalance.json`` (``rebalances``: every check that changed the split, with
  partitions, stage times measured before, predicted after and measured after, migrations;
  ``memory_plans``: every stage's plan each time they were decided) and
  ``pipeline_stage_times.png`` (per-stage time before and after each rebalance) in the log
  directory.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_hier.checks import check_flag, check_path
from lightning_hier.strategies.hier_pipeline import HierPipelineStrategy

log = logging.getLogger(__name__)


class StageRebalancer(Callback):
    """Logs per-stage times, partitions, migrations and memory plans of ``hier_pipeline`` and writes them
    to ``pipeline_rebalance.json`` (and a figure). The rebalancing itself is configured on the strategy:
    ``HierPipelineStrategy(rebalance=...)``. See ``docs/hier_pipeline.md``.

    Args:
        save_figure: draw ``pipeline_stage_times.png`` (needs matplotlib).
        output_dir: where files go; default the logger's directory.
    """

    def __init__(self, save_figure: bool = True, output_dir: str | None = None) -> None:
        check_flag("save_figure", save_figure)
        check_path("output_dir", output_dir)
        self.save_figure = save_figure
        self.output_dir = output_dir
        self._events_seen = 0
        self._memory_seen = 0
        self.memory_plans: list[dict[str, Any]] = []
        self._decision_seen: Any = None
        self.events: list[dict[str, Any]] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, HierPipelineStrategy):
            raise ValueError(
                f"StageRebalancer needs strategy='hier_pipeline', got {type(strategy).__name__}."
            )

    def _directory(self, trainer: pl.Trainer) -> Path:
        # not trainer.log_dir: it broadcasts (a collective) and this runs on rank 0 only
        logger_dir = trainer.logger.log_dir if trainer.logger is not None else None
        path = Path(self.output_dir or logger_dir or trainer.default_root_dir)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if engine is None or not trainer.is_global_zero:
            return
        decision = engine.last_decision
        if decision is not None and decision is not self._decision_seen:
            self._decision_seen = decision
            metrics = {f"pipeline/stage_time_{s}": t * 1e3 for s, t in enumerate(decision.stage_times)}
            metrics["pipeline/imbalance"] = decision.imbalance_before
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)
        new_events = engine.history[self._events_seen :]
        self._events_seen = len(engine.history)
        for event in new_events:
            record = event.to_dict()
            self.events.append(record)
            moved = sum(len(r["layers"]) for r in record["migration"]) // 2
            sent = sum(r["bytes_sent"] for r in record["migration"])
            pl_module.log_dict(
                {
                    "pipeline/migrated_layers": float(moved),
                    "pipeline/migrated_bytes": float(sent),
                    "pipeline/migration_pause_s": record["pause_seconds"],
                },
                on_step=True,
                on_epoch=False,
                rank_zero_only=True,
            )
            log.info(
                "hier_pipeline rebalanced at step %d: %s -> %s", record["step"], record["old"], record["new"]
            )
        for record in engine.memory_events[self._memory_seen :]:
            self.memory_plans.append(record)
            counts = {p: sum(plan["counts"][p] for plan in record["plans"]) for p in ("swap", "recompute")}
            pl_module.log_dict(
                {
                    "pipeline/swap_layers": float(counts["swap"]),
                    "pipeline/recompute_layers": float(counts["recompute"]),
                },
                on_step=True,
                on_epoch=False,
                rank_zero_only=True,
            )
            log.info(
                "hier_pipeline memory plans at step %d: %s",
                record["step"],
                [p["summary"] for p in record["plans"]],
            )
            new_events = new_events or [None]
        self._memory_seen = len(engine.memory_events)
        # the first check after a rebalance measures the new split: "after (measured)" in the figure
        for record in self.events:
            if record.get("measured_after") is None:
                later = [c for c in engine.checks if c["step"] > record["step"]]
                if later:
                    record["measured_after"] = later[0]["stage_times"]
                    new_events = new_events or [None]
        if new_events:
            self._write(trainer)

    def _write(self, trainer: pl.Trainer) -> None:
        directory = self._directory(trainer)
        record = {"rebalances": self.events, "memory_plans": self.memory_plans}
        (directory / "pipeline_rebalance.json").write_text(json.dumps(record, indent=2, default=str))
        if self.save_figure:
            try:
                draw_stage_times(self.events, directory / "pipeline_stage_times.png")
            except ImportError:
                log.warning("StageRebalancer: install matplotlib to get pipeline_stage_times.png")


def draw_stage_times(events: list[dict[str, Any]], path: Path) -> None:
    """One panel per rebalance: stage times measured before, predicted after and, once the next
    check has run, measured after (ms per micro-batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not events:
        return
    fig, axes = plt.subplots(1, len(events), figsize=(4 * len(events), 3.2), squeeze=False)
    for ax, event in zip(axes[0], events):
        before = [t * 1e3 for t in event["stage_times"]]
        after = [t * 1e3 for t in event["predicted_times"]]
        xs = range(len(before))
        ax.bar(
            [x - 0.2 for x in xs], before, width=0.4, label=f"before (imb {event['imbalance_before']:.2f})"
        )
        ax.bar([x + 0.2 for x in xs], after, width=0.4, label=f"after (imb {event['imbalance_after']:.2f})")
        ax.set_xticks(list(xs))
        ax.set_xlabel("stage")
        ax.set_ylabel("ms per micro-batch")
        ax.set_title(f"step {event['step']}, pause {event['pause_seconds'] * 1e3:.0f} ms")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
