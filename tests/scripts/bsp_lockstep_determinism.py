"""Run under torchrun (2 processes): ``hier_bsp`` with ``superstep=2, max_staleness=0`` against ``ddp``
with ``accumulate_grad_batches=2``, in float64, with rank 1 held back.

Each superstep of two micro-steps per worker sums what one of ``ddp``'s accumulated optimizer steps sums,
so the parameters must equal ``ddp``'s to rounding, whatever the timing. Rank 1 collates every batch late,
so rank 0 folds a superstep's second micro-step, and at an epoch's end drains, while rank 1 still computes
its first, and with shared batches rank 0 claims ahead of rank 1: a run whose result depends on who gets
somewhere first shows here.
Scenarios: ``fixed_shards`` (the lockstep default) and ``shared_batches`` (``_share_batches=True``).
Rank 0 writes ``{scenario: {"max_abs_diff": ..., "micro_steps": ..., "reference_moved": ...}}`` to argv[1].
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from models import EquivModel, built, loader, make_dataset  # noqa: E402
from torch.utils.data import DataLoader, default_collate  # noqa: E402

from lightning_hier import HierBSPStrategy  # noqa: E402

SUPERSTEP = 2
BATCHES_PER_WORKER = 6  # per epoch; 3 supersteps of 2 micro-steps per worker
HOLD_BACK_S = 0.2
WORLD = int(os.environ["WORLD_SIZE"])


def held_back_batches() -> DataLoader:
    """The seeded batches, each collated late on rank 1: its micro-steps start late, and so do its batch
    claims (a claim is made as a batch is fetched, before it is collated)."""
    data = make_dataset(n=BATCHES_PER_WORKER * 8 * WORLD)

    def collate(samples: list) -> list:
        if int(os.environ["RANK"]) == 1:
            time.sleep(HOLD_BACK_S)
        return default_collate(samples)

    return DataLoader(data, batch_size=8, shuffle=False, collate_fn=collate)


def train(strategy: object, accumulate: int, held_back: bool) -> dict:
    pl.seed_everything(1234, verbose=False)
    model = EquivModel(optimizer="sgd")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_epochs=2,
        precision="64-true",
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    batches = held_back_batches() if held_back else loader(n=BATCHES_PER_WORKER * 8 * WORLD)
    trainer.fit(model, train_dataloaders=batches)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_abs_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def main() -> None:
    out = Path(sys.argv[1])
    reference = train(DDPStrategy(), SUPERSTEP, held_back=False)
    pl.seed_everything(1234, verbose=False)
    initial = {k: v.double() for k, v in EquivModel(optimizer="sgd").state_dict().items()}
    results = {}
    for name, tuning in {"fixed_shards": {}, "shared_batches": {"_share_batches": True}}.items():
        settings = dict(superstep=SUPERSTEP, max_staleness=0, devices_per_node=1, bucket_cap_mb=0.002)
        strategy = built(HierBSPStrategy, **settings, **tuning)
        state = train(strategy, 1, held_back=True)
        results[name] = {
            "max_abs_diff": max_abs_diff(reference, state),
            "micro_steps": [list(r.micro_steps) for r in strategy.superstep_records],
            "reference_moved": max_abs_diff(reference, initial),
        }
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
