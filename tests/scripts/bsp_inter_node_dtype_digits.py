"""Run under torchrun (4 processes as 2 nodes x 2): the digits example under ``hier_bsp`` in lockstep
(``superstep=1, max_staleness=0``: ``ddp``'s steps) with the push across nodes in full precision, bf16 and
int8. Rank 0 writes to argv[1], per run: the loss over the whole training set, the supersteps, the distance
of the parameters from the full-precision run's (``distance``) and how far the run moved them (``travel``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn

from lightning_hier import HierBSPStrategy
from lightning_hier.examples.digits import DigitsClassifier, DigitsDataModule

EPOCHS = 4


def train(inter_node_dtype: str | None) -> tuple[dict, list[torch.Tensor], list[torch.Tensor]]:
    pl.seed_everything(0, verbose=False)
    data = DigitsDataModule(batch_size=32)
    model = DigitsClassifier(hidden=128, lr=0.1, momentum=0.9)
    initial = [p.detach().clone() for p in model.parameters()]
    strategy = HierBSPStrategy(
        devices_per_node=2,
        superstep=1,
        max_staleness=0,
        inter_node_dtype=inter_node_dtype,
        log_supersteps=False,
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, max_epochs=EPOCHS, num_sanity_val_steps=0, limit_val_batches=0,
        strategy=strategy, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, data)
    x, y = zip(*data.train_set)
    with torch.no_grad():
        loss = float(nn.functional.cross_entropy(model(torch.stack(x)), torch.tensor(y)))
    final = [p.detach().clone() for p in model.parameters()]
    return {"loss": loss, "supersteps": len(strategy.superstep_records)}, initial, final


def distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return sum(float((x - y).double().pow(2).sum()) for x, y in zip(a, b)) ** 0.5


def main() -> None:
    results, finals = {}, {}
    for name in ("fp32", "bf16", "int8"):
        results[name], initial, finals[name] = train(None if name == "fp32" else name)
    for name in results:
        results[name]["distance"] = distance(finals[name], finals["fp32"])
        results[name]["travel"] = distance(finals[name], initial)
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
