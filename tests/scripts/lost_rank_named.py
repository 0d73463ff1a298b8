"""A 2-process fit in which rank 1 SIGKILLs itself in the middle of its fourth step.

``lost_rank_named.py STRATEGY OUT``: ``STRATEGY`` is ``hier_sliced`` or ``hier_pipeline``. Rank 1 writes
``OUT/died_at`` (when) just before it dies; rank 0 writes ``OUT/rank0.json`` (the error with its notes,
when it ended) and lets the error end the process, so its traceback goes to stderr."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
from models import EquivModel, Regressor, loader  # noqa: E402

from lightning_hier import HierPipelineStrategy, HierSlicedStrategy  # noqa: E402

RANK = int(os.environ["RANK"])
TIMEOUT = timedelta(seconds=30)
DIE_AT_BATCH = 3


def die(out: Path) -> None:
    (out / "died_at").write_text(str(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


class DyingEquivModel(EquivModel):
    """Rank 1 dies after its forward of batch 3: rank 0 is then inside that step's reduction."""

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        loss = super().training_step(batch, batch_idx)
        if RANK == 1 and batch_idx == DIE_AT_BATCH:
            die(Path(sys.argv[2]))
        return loss


class DieInSchedule(pl.Callback):
    """Rank 1 (a stage of the pipeline) dies as batch 3 begins: rank 0 is then in that step's 1F1B
    exchange with it."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        if RANK == 1 and batch_idx == DIE_AT_BATCH:
            die(self.out)


def main() -> None:
    name, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    pl.seed_everything(7, verbose=False)
    callbacks: list[pl.Callback] = []
    if name == "hier_sliced":
        strategy = HierSlicedStrategy(devices_per_node=2, bucket_cap_mb=0.002, timeout=TIMEOUT)
        model = DyingEquivModel(optimizer="sgd")
        data = loader(n=128)
    else:
        strategy = HierPipelineStrategy(timeout=TIMEOUT)
        model = Regressor()
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=generator)
        data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
        callbacks.append(DieInSchedule(out))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False, callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        use_distributed_sampler=name != "hier_pipeline",
    )  # fmt: skip
    try:
        trainer.fit(model, train_dataloaders=data)
    except Exception as err:
        error = "\n".join([f"{type(err).__name__}: {err}", *getattr(err, "__notes__", ())])
        (out / f"rank{RANK}.json").write_text(json.dumps({"error": error, "ended": time.time()}))
        raise


if __name__ == "__main__":
    main()
