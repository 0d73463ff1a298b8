"""One process per rank (``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_*`` set by the test): a ``hier_bsp`` run
whose ``training_step`` raises in the first epoch, on every rank (``every``) or on rank 1 only (``one``).

``bsp_raising_step.py OUT WHO`` has every rank write ``OUT/rank<r>.json`` with the error it ended with
and when, and the rank that raised writes ``OUT/raised_at``."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
from models import EquivModel, loader  # noqa: E402

from lightning_hier import HierBSPStrategy  # noqa: E402


class RaisingModel(EquivModel):
    def __init__(self, out: Path, who: str) -> None:
        super().__init__(optimizer="sgd")
        self.out_dir, self.who = out, who

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        if batch_idx == 3 and (self.who == "every" or self.global_rank == 1):
            (self.out_dir / "raised_at").write_text(str(time.time()))
            raise ValueError(f"boom on rank {self.global_rank}")
        return super().training_step(batch, batch_idx)


def main() -> None:
    out, who = Path(sys.argv[1]), sys.argv[2]
    strategy = HierBSPStrategy(
        superstep_steps=1, max_staleness=1, devices_per_node=1, bucket_cap_mb=0.002,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, num_nodes=2, strategy=strategy, max_epochs=2, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    error = None
    try:
        trainer.fit(RaisingModel(out, who), train_dataloaders=loader())
    except Exception as err:  # noqa: BLE001 - recorded for the test
        error = f"{type(err).__name__}: {err}"
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"error": error, "ended": time.time()}))
    os._exit(0)  # do not wait for a group a failed peer may have left


if __name__ == "__main__":
    main()
