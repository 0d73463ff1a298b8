"""Run under torchrun (2 processes): a HybridEmbedding model under Lightning's ``ddp`` must stop with
a clear error at its first training step instead of training a table that never changes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
import torch.distributed as dist  # noqa: E402
from hybrid_checks import Click, loader  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip
    try:
        trainer.fit(Click(hybrid=True, optimizer="sgd"), train_dataloaders=loader())
        error = None
    except RuntimeError as err:
        error = str(err)
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"error": error}))


if __name__ == "__main__":
    main()
