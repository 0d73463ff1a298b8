"""One process per rank (``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_*`` set by the test, as separate node
agents would start them): rank 3 of a ``hier_bsp`` run dies in the second epoch.

``bsp_dead_worker.py OUT`` has every surviving rank write ``OUT/rank<r>.json`` with the error it
ended with and when; a checkpoint is saved at the end of every epoch under ``OUT/ckpt``."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from models import EquivModel, loader  # noqa: E402

from lightning_hier import HierBSPStrategy  # noqa: E402

DEATH_FILE = "died_at"


class DieOnRank3(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_rank == 3 and trainer.current_epoch == 1 and batch_idx == 3:
            (self.out / DEATH_FILE).write_text(str(time.time()))
            os._exit(17)


def main() -> None:
    out = Path(sys.argv[1])
    strategy = HierBSPStrategy(
        superstep=1,
        max_staleness=1,
        devices_per_node=2,
        bucket_cap_mb=0.002,
        timeout=timedelta(seconds=60),
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_epochs=3, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[DieOnRank3(out), ModelCheckpoint(dirpath=out / "ckpt", every_n_epochs=1, save_top_k=-1)],
    )  # fmt: skip
    error = None
    try:
        trainer.fit(EquivModel(optimizer="sgd"), train_dataloaders=loader())
    except Exception as err:  # noqa: BLE001 - recorded for the test
        error = f"{type(err).__name__}: {err}"
    result = {"error": error, "ended": time.time()}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    os._exit(0)  # do not wait for a group whose member is gone


if __name__ == "__main__":
    main()
