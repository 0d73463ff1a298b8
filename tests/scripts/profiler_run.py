"""Run under torchrun (2 processes): hier_sliced with bucketing="time" and GradientTimingProfiler.

argv[1]: output directory (CSV logs, figure, plan); rank 0 writes summary.json there.
argv[2] (optional) "control": the same run without ``reprofile_every_n_epochs``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from models import EquivModel, loader  # noqa: E402

from lightning_hier import GradientTimingProfiler, HierSlicedStrategy, TimeBuckets  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    pl.seed_everything(0, verbose=False)
    control = len(sys.argv) > 2 and sys.argv[2] == "control"
    # reprofile_threshold=1.0: drift never re-profiles, so only the callback's request can
    strategy = HierSlicedStrategy(
        devices_per_node=1, bucket_cap_mb=0.004,
        bucketing=TimeBuckets(min_bucket_mb=0, profile_steps=2, reprofile_threshold=1.0),
    )  # fmt: skip
    profiler = GradientTimingProfiler(reprofile_every_n_epochs=None if control else 1, log_every_n_steps=1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, callbacks=[profiler],
        log_every_n_steps=1,
        logger=CSVLogger(str(out), name="logs"), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(EquivModel(hidden=64), train_dataloaders=loader(n=512))
    log_dir = trainer.log_dir  # a collective: every rank asks
    if dist.get_rank() == 0:
        summary = {
            "log_dir": log_dir,
            "plans_made": strategy.engine.time_bucketing.plans_made,
            "hidden_fractions": profiler.hidden_fractions,
            "num_buckets": len(strategy.engine.buckets),
        }
        (out / "summary.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
