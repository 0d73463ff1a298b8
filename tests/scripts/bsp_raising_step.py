"""One process per rank (``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_*`` set by the test): a ``hier_bsp`` run
whose ``training_step`` raises in the first epoch, on every rank (``every``: at the same batch, once all
have reached it) or on rank 1 only (``one``).

``bsp_raising_step.py OUT WHO`` has every rank write ``OUT/rank<r>.json`` with the error it ended with
and when, and the rank that raised writes ``OUT/raised_at``. ``ModelCheckpoint(save_on_exception=True)``
saves ``OUT/exception.ckpt`` on the way out (Lightning calls it before the strategy hears of the error);
rank 0 records what the checkpoint holds and whether it loads into a fresh module."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from models import EquivModel, loader  # noqa: E402

from lightning_hier import HierBSPStrategy  # noqa: E402


class RaisingModel(EquivModel):
    def __init__(self, out: Path, who: str) -> None:
        super().__init__(optimizer="sgd")
        self.out_dir, self.who = out, who

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        if batch_idx == 3 and (self.who == "every" or self.global_rank == 1):
            if self.who == "every":
                self._meet_the_others()
            (self.out_dir / "raised_at").write_text(str(time.time()))
            raise ValueError(f"boom on rank {self.global_rank}")
        return super().training_step(batch, batch_idx)

    def _meet_the_others(self) -> None:
        """Workers run free: without this, a worker still a step behind can hear that the first one
        stopped before it reaches its own raise (it then ends with ``BSPStopped``, rightly, but that is
        the ``one`` case). A file per rank, not a collective, so the BSP machinery is not involved."""
        (self.out_dir / f"reached_{self.global_rank}").touch()
        deadline = time.time() + 30
        while len(list(self.out_dir.glob("reached_*"))) < self.trainer.world_size and time.time() < deadline:
            time.sleep(0.01)


def main() -> None:
    out, who = Path(sys.argv[1]), sys.argv[2]
    strategy = HierBSPStrategy(
        superstep=1, max_staleness=1, devices_per_node=1, bucket_cap_mb=0.002,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    on_exception = ModelCheckpoint(
        dirpath=out, filename="exception", save_on_exception=True, every_n_epochs=9
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, num_nodes=2, strategy=strategy, max_epochs=2, logger=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[on_exception],
    )  # fmt: skip
    error = None
    model = RaisingModel(out, who)
    try:
        trainer.fit(model, train_dataloaders=loader())
    except Exception as err:  # noqa: BLE001 - recorded for the test
        error = f"{type(err).__name__}: {err}"
    result = {"error": error, "ended": time.time()}
    if trainer.global_rank == 0:
        saved = torch.load(out / "exception.ckpt", weights_only=False)
        fresh = EquivModel(optimizer="sgd")
        fresh.load_state_dict(saved["state_dict"])  # loads without the plugin
        result["checkpoint"] = {
            "keys_match": sorted(saved["state_dict"]) == sorted(model.state_dict()),
            "equals_worker_model": all(
                torch.equal(v, model.state_dict()[k]) for k, v in saved["state_dict"].items()
            ),
            "optimizer_groups": len(saved["optimizer_states"][0]["param_groups"]),
        }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    os._exit(0)  # do not wait for a group a failed peer may have left


if __name__ == "__main__":
    main()
