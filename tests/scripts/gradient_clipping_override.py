"""Run under torchrun (2 processes): what a LightningModule's own ``configure_gradient_clipping`` sees in
``param.grad`` after calling ``super()``, under ``ddp`` and under ``hier_sliced`` (one node of two devices).

Under ``ddp`` every ``.grad`` there is the averaged gradient, clipped by ``super()`` (Lightning's
``test_gradient_clipping_by_norm`` / ``_by_value`` check the norm and the largest value); the optimizer
then steps it. The module is float64 so the two strategies' records agree to rounding. Rank 0 writes every
rank's records per strategy and algorithm to argv[1].
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
from models import EquivModel, loader  # noqa: E402
from torch import nn  # noqa: E402

from lightning_hier import HierSlicedStrategy  # noqa: E402

CLIP = {"norm": 0.05, "value": 0.004}
STEPS = 3


class ClipsAndReads(EquivModel):
    """Reads every ``.grad`` right after Lightning's clipping, as Lightning's own clipping tests do."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        self.double()
        self.seen: list[dict[str, float | list[float]]] = []

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return nn.functional.cross_entropy(self(x.double()), y)

    def configure_gradient_clipping(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().configure_gradient_clipping(*args, **kwargs)
        grads = [p.grad.detach() for p in self.parameters()]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        largest = torch.stack([g.abs().max() for g in grads]).max()
        flat = torch.cat([g.flatten() for g in grads])
        self.seen.append({"norm": norm.item(), "max_abs": largest.item(), "grads": flat.tolist()})


def run(strategy: str | HierSlicedStrategy, algorithm: str) -> dict:
    pl.seed_everything(5, verbose=False)
    model = ClipsAndReads()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, gradient_clip_val=CLIP[algorithm], gradient_clip_algorithm=algorithm,
    )  # fmt: skip
    # each rank its own batches (RANK is set by torchrun before the process group exists)
    trainer.fit(model, loader(batch_size=8, n=64, seed=int(os.environ["RANK"])))
    params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    return {"seen": model.seen, "params": params}


def main() -> None:
    out = Path(sys.argv[1])
    results = {}
    for algorithm in CLIP:
        results[f"ddp/{algorithm}"] = run("ddp", algorithm)
        # a small bucket cap: several buckets, each cut in two slices
        results[f"hier_sliced/{algorithm}"] = run(
            HierSlicedStrategy(devices_per_node=2, bucket_cap_mb=0.002), algorithm
        )
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"clip": CLIP, "steps": STEPS, "ranks": gathered}))


if __name__ == "__main__":
    main()
