"""Run under torchrun (2 processes): a peer dies in the middle of a superstep's push while the surviving
rank's local BSP module waits on that push forever, as it waits on an NCCL collective whose peer is
gone (over gloo the push would fail at once and the module would name the rank itself).

``bsp_stuck_collective.py OUT`` has rank 1 write ``OUT/died_at`` and exit inside its 4th push; rank 0's
4th push blocks until training raised (a callback's ``on_exception`` lets it go, so the module's thread
ends at teardown). Rank 0 writes ``OUT/rank0.json`` with the error its fit ended with and when. The
strategy's ``timeout`` is 20 s: the groups' and NCCL's watchdog's.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
from models import EquivModel, loader  # noqa: E402

from lightning_hier import HierBSPStrategy  # noqa: E402

TIMEOUT_S = 20
STUCK_PUSH = 4


class StuckPush(pl.Callback):
    """Wraps the parameter server's push (called on the local BSP module's thread)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.released = threading.Event()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        server = trainer.strategy.engine.server
        push, calls = server.push, [0]

        def stuck_push(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[0] += 1
            if calls[0] == STUCK_PUSH and trainer.global_rank == 1:
                time.sleep(0.5)  # rank 0 has gone past the superstep's gather into its own push
                (self.out / "died_at").write_text(str(time.time()))
                os._exit(0)
            if calls[0] == STUCK_PUSH:
                self.released.wait()
                return 0
            return push(*args, **kwargs)

        server.push = stuck_push

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, error: BaseException) -> None:
        self.released.set()


def main() -> None:
    out = Path(sys.argv[1])
    strategy = HierBSPStrategy(
        superstep=1, max_staleness=1, bucket_cap_mb=0.002, timeout=timedelta(seconds=TIMEOUT_S)
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=out, callbacks=[StuckPush(out)],
    )  # fmt: skip
    error = None
    try:
        trainer.fit(EquivModel(optimizer="sgd"), train_dataloaders=loader())
    except Exception as err:  # noqa: BLE001 - recorded for the test
        error = f"{type(err).__name__}: {err}"
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps({"error": error, "ended": time.time()}))
    os._exit(0)  # do not wait for a group whose member is gone


if __name__ == "__main__":
    main()
