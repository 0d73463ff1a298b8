"""Run under torchrun (3 processes): two training steps of a 3-stage ``hier_pipeline`` fit, with the groups
built as on CUDA and every operation recorded (``LIGHTNING_HIER_DEVICE_BACKEND`` and
``LIGHTNING_HIER_AUDIT_DIR`` set by tests/test_pipeline_first_exchange.py, which reads the records)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
from pipeline_models import SkewedNet, loader  # noqa: E402

from lightning_hier import HierPipelineStrategy  # noqa: E402


def main() -> None:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=3,
        strategy=HierPipelineStrategy(micro_batches=4),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=sys.argv[1],
    )
    trainer.fit(SkewedNet(), loader())


if __name__ == "__main__":
    main()
