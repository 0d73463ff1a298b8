"""Run under torchrun (4 processes): save -> resume equals an uninterrupted run.

Writes JSON to argv[1] (rank 0) with the relative differences of interest; argv[2] is a scratch dir.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from models import EquivModel, loader  # noqa: E402
from train_equivalence import max_rel_diff  # noqa: E402

from lightning_hier import HierSlicedStrategy  # noqa: E402

MODEL = dict(optimizer="adamw_groups", scheduler=True)


def fit(strategy, epochs: int, ckpt_path: str | None = None) -> tuple[pl.Trainer, EquivModel]:  # noqa: ANN001
    pl.seed_everything(7, verbose=False)
    model = EquivModel(**MODEL)
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_epochs=epochs, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=loader(), ckpt_path=ckpt_path)
    return trainer, model


def params(model: torch.nn.Module) -> dict:
    return {k: v.detach().clone().float() for k, v in model.state_dict().items()}


def main() -> None:
    out, scratch = Path(sys.argv[1]), Path(sys.argv[2])
    ckpt = str(scratch / "epoch1.ckpt")
    _, uninterrupted = fit(HierSlicedStrategy(devices_per_node=2, bucket_cap_mb=0.002), epochs=2)
    trainer, half = fit(HierSlicedStrategy(devices_per_node=2, bucket_cap_mb=0.002), epochs=1)
    trainer.save_checkpoint(ckpt)
    half_params = params(half)
    _, resumed = fit(HierSlicedStrategy(devices_per_node=2, bucket_cap_mb=0.002), epochs=2, ckpt_path=ckpt)
    _, resumed_other_topology = fit(
        HierSlicedStrategy(devices_per_node=4, slice_weights="equal", bucket_cap_mb=0.01),
        epochs=2,
        ckpt_path=ckpt,
    )
    _, resumed_under_ddp = fit(DDPStrategy(), epochs=2, ckpt_path=ckpt)
    if dist.get_rank() != 0:
        return
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=False)
    plain = EquivModel(**MODEL)
    plain.load_state_dict(checkpoint["state_dict"])
    reference_optimizer = plain.configure_optimizers()["optimizer"]
    reference_optimizer.load_state_dict(checkpoint["optimizer_states"][0])  # loads as an unsharded state
    results = {
        "resumed_vs_uninterrupted": max_rel_diff(params(uninterrupted), params(resumed)),
        "other_topology_vs_uninterrupted": max_rel_diff(
            params(uninterrupted), params(resumed_other_topology)
        ),
        "ddp_resume_vs_uninterrupted": max_rel_diff(params(uninterrupted), params(resumed_under_ddp)),
        "plain_module_vs_saved": max_rel_diff(half_params, params(plain)),
        "second_epoch_moved": max_rel_diff(params(uninterrupted), half_params),
        "state_entries": len(checkpoint["optimizer_states"][0]["state"]),
        "num_params": len(list(plain.parameters())),
    }
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
