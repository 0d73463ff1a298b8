"""Run under torchrun (2 processes, 2 nodes x 1): ``16-mixed`` under hier_sliced with a HybridEmbedding.

``amp_checks.py OUT`` writes a JSON summary on rank 0:

- ``scaled`` / ``unscaled``: tables, dense parameters and final loss scale after 4 steps with the
  loss scaled by 1024 (growth x4 every 2 steps) and by 1 (same growth): with the table's gradient
  unscaled as the dense ones are, the two runs agree (the scales are powers of two);
- ``overflow``: a step whose embedding gradient is infinite on rank 1 only (dense gradients finite):
  the scaler must skip that step on both ranks for the dense parameters and the table alike;
- ``settings``: the scaler the strategy installs keeps the user's growth and backoff settings.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
from hybrid_checks import Click  # noqa: E402
from hybrid_checks import loader as hybrid_loader  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from lightning_hier import HierSlicedStrategy  # noqa: E402
from lightning_hier.sliced.sharded_grad_scaler import HierGradScaler  # noqa: E402


class _InfinitGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad * float("inf")


class Poisoned(Click):
    """On step ``poison_step`` rank 1's embedding gradient is infinite; everything else is finite."""

    def __init__(self, poison_step: int | None = None) -> None:
        super().__init__(hybrid=True, optimizer="sgd")
        self.poison_step = poison_step
        self.snapshots: list[dict] = []

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        ids, target = batch
        bags = self.emb(ids)
        if self.global_step == self.poison_step and self.global_rank == 1:
            bags = _InfinitGradient.apply(bags)
        return (self.head(bags).float() - target).pow(2).mean()

    def on_train_batch_end(self, outputs, batch, batch_idx):  # noqa: ANN001, ANN201
        scaler = self.trainer.precision_plugin.scaler
        self.snapshots.append(
            {
                "table": self.emb.weight.clone().tolist(),
                "head": self.head.weight.detach().clone().tolist(),
                "scale": scaler.get_scale(),
            }
        )


def fit(init_scale: float, poison_step: int | None = None, steps: int = 4) -> tuple[Poisoned, pl.Trainer]:
    pl.seed_everything(0, verbose=False)
    model = Poisoned(poison_step)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=4.0, growth_interval=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=HierSlicedStrategy(devices_per_node=1), max_steps=steps,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=hybrid_loader())
    return model, trainer


def main() -> None:
    out = Path(sys.argv[1])
    results: dict = {}
    for name, scale in (("scaled", 1024.0), ("unscaled", 1.0)):
        model, _ = fit(scale)
        results[name] = model.snapshots
    tables = [None] * 2
    dist.all_gather_object(tables, results["scaled"][-1]["table"])
    results["tables_equal_across_nodes"] = tables[0] == tables[1]

    model, trainer = fit(256.0, poison_step=2)
    results["overflow"] = model.snapshots
    scaler = trainer.precision_plugin.scaler
    results["settings"] = {
        "type": type(scaler).__name__,
        "is_hier": isinstance(scaler, HierGradScaler),
        "growth_factor": scaler.get_growth_factor(),
        "backoff_factor": scaler.get_backoff_factor(),
        "growth_interval": scaler.get_growth_interval(),
    }
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
