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
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from models import EquivModel, loader  # noqa: E402
from train_equivalence import max_rel_diff  # noqa: E402

from lightning_hier import (  # noqa: E402
    HierBSPStrategy,
    HierSlicedStrategy,
    TimeBuckets,
    consolidate_sharded_checkpoint,
)

MODEL = dict(optimizer="adamw_groups", scheduler=True)


def fit(
    strategy, epochs: int, ckpt_path: str | None = None, callbacks=None, model=None
) -> tuple[pl.Trainer, EquivModel]:  # noqa: ANN001, E501
    pl.seed_everything(7, verbose=False)
    model = EquivModel(**(model or MODEL))
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_epochs=epochs, logger=False,
        enable_checkpointing=bool(callbacks), callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False,
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

    # sharded: ModelCheckpoint every 4 steps keeping the last one (older directories are removed)
    def sharded() -> HierSlicedStrategy:
        return HierSlicedStrategy(devices_per_node=2, bucket_cap_mb=0.002, checkpoint_format="sharded")

    saver = ModelCheckpoint(
        dirpath=str(scratch / "sharded"), every_n_train_steps=4, save_top_k=1, monitor="step", mode="max"
    )
    fit(sharded(), epochs=1, callbacks=[saver])
    sharded_dirs = sorted(p.name for p in (scratch / "sharded").iterdir())
    sharded_ckpt = saver.best_model_path
    _, resumed_sharded = fit(sharded(), epochs=2, ckpt_path=sharded_ckpt)
    layout_error = ""
    try:
        fit(
            HierSlicedStrategy(devices_per_node=4, checkpoint_format="sharded"),
            epochs=2,
            ckpt_path=sharded_ckpt,
        )
    except ValueError as err:
        layout_error = str(err)

    # time bucketing: the plan is saved with the checkpoint and resumed without profiling again
    def timed() -> HierSlicedStrategy:
        return HierSlicedStrategy(
            devices_per_node=2, bucket_cap_mb=0.002, bucketing=TimeBuckets(profile_steps=2, min_bucket_mb=0.0)
        )

    _, timed_whole = fit(timed(), epochs=2)
    timed_half, _ = fit(timed(), epochs=1)
    time_ckpt = str(scratch / "timed.ckpt")
    timed_half.save_checkpoint(time_ckpt)
    saved_plan = timed_half.strategy.engine.time_bucketing.plan.to_dict()
    timed_resumed, timed_model = fit(timed(), epochs=2, ckpt_path=time_ckpt)
    resumed_bucketing = timed_resumed.strategy.engine.time_bucketing
    # an optimizer kept whole on every rank (Adafactor: not elementwise): its own state_dict in the
    # checkpoint, resumed under hier_sliced and under ddp
    whole_ckpt = str(scratch / "whole.ckpt")
    adafactor = dict(optimizer="adafactor")
    _, whole_uninterrupted = fit(HierSlicedStrategy(devices_per_node=2), epochs=2, model=adafactor)
    whole_trainer, whole_half = fit(HierSlicedStrategy(devices_per_node=2), epochs=1, model=adafactor)
    whole_trainer.save_checkpoint(whole_ckpt)
    _, whole_resumed = fit(
        HierSlicedStrategy(devices_per_node=2), epochs=2, ckpt_path=whole_ckpt, model=adafactor
    )
    _, whole_under_ddp = fit(DDPStrategy(), epochs=2, ckpt_path=whole_ckpt, model=adafactor)

    # the same optimizer on hier_bsp's whole-parameter server (devices_per_node=1, plain BSP), resumed
    def whole_server() -> HierBSPStrategy:
        return HierBSPStrategy(devices_per_node=1, superstep=1, max_staleness=0)

    server_ckpt = str(scratch / "whole_server.ckpt")
    _, server_uninterrupted = fit(whole_server(), epochs=2, model=adafactor)
    server_trainer, _ = fit(whole_server(), epochs=1, model=adafactor)
    server_trainer.save_checkpoint(server_ckpt)
    _, server_resumed = fit(whole_server(), epochs=2, ckpt_path=server_ckpt, model=adafactor)
    if dist.get_rank() != 0:
        return
    converted = consolidate_sharded_checkpoint(sharded_ckpt)
    plain_from_sharded = EquivModel(**MODEL)
    plain_from_sharded.load_state_dict(converted["state_dict"])
    plain_from_sharded.configure_optimizers()["optimizer"].load_state_dict(converted["optimizer_states"][0])
    consolidated_states = torch.load(ckpt, map_location="cpu", weights_only=False)["optimizer_states"][0][
        "state"
    ]
    optimizer_state_diff = max(
        (consolidated_states[i][k] - converted["optimizer_states"][0]["state"][i][k]).abs().max().item()
        for i in consolidated_states
        for k in ("exp_avg", "exp_avg_sq")
    )
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=False)
    plain = EquivModel(**MODEL)
    plain.load_state_dict(checkpoint["state_dict"])
    reference_optimizer = plain.configure_optimizers()["optimizer"]
    reference_optimizer.load_state_dict(checkpoint["optimizer_states"][0])  # loads as an unsharded state
    results = {
        "whole_second_epoch_moved": max_rel_diff(params(whole_uninterrupted), params(whole_half)),
        "whole_resumed_vs_uninterrupted": max_rel_diff(params(whole_uninterrupted), params(whole_resumed)),
        "whole_ddp_resume_vs_uninterrupted": max_rel_diff(
            params(whole_uninterrupted), params(whole_under_ddp)
        ),
        "whole_server_vs_hier_sliced_whole": max_rel_diff(
            params(whole_uninterrupted), params(server_uninterrupted)
        ),
        "whole_server_resumed_vs_uninterrupted": max_rel_diff(
            params(server_uninterrupted), params(server_resumed)
        ),
        "resumed_vs_uninterrupted": max_rel_diff(params(uninterrupted), params(resumed)),
        "other_topology_vs_uninterrupted": max_rel_diff(
            params(uninterrupted), params(resumed_other_topology)
        ),
        "ddp_resume_vs_uninterrupted": max_rel_diff(params(uninterrupted), params(resumed_under_ddp)),
        "plain_module_vs_saved": max_rel_diff(half_params, params(plain)),
        "second_epoch_moved": max_rel_diff(params(uninterrupted), half_params),
        "state_entries": len(checkpoint["optimizer_states"][0]["state"]),
        "num_params": len(list(plain.parameters())),
        "sharded_dirs": sharded_dirs,
        "sharded_resumed_vs_uninterrupted": max_rel_diff(params(uninterrupted), params(resumed_sharded)),
        "sharded_converted_vs_half": max_rel_diff(half_params, params(plain_from_sharded)),
        "sharded_vs_consolidated_optimizer_state": optimizer_state_diff,
        "layout_error": layout_error,
        "time_plan_saved": torch.load(time_ckpt, map_location="cpu", weights_only=False)["hier_sliced"][
            "time_plan"
        ]
        == saved_plan,
        "time_plan_restored": resumed_bucketing.plan.to_dict() == saved_plan,
        "time_plans_made_after_resume": resumed_bucketing.plans_made,
        "time_buckets_after_resume": len(timed_resumed.strategy.engine.buckets),
        "time_buckets_in_plan": len(saved_plan["buckets"]),
        "time_resumed_vs_uninterrupted": max_rel_diff(params(timed_whole), params(timed_model)),
    }
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
