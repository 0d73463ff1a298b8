"""Run under torchrun: train the same model under `ddp` and `hier_sliced`, compare parameters.

Rank 0 writes ``{scenario: {"max_rel_diff": ..., ...}}`` as JSON to the path in argv[1].
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
from models import EquivModel, loader, tuned  # noqa: E402

from lightning_hier import HierSlicedStrategy, TimeBuckets  # noqa: E402

SCENARIOS: dict[str, dict] = {
    "sgd_momentum_2x2": dict(model=dict(optimizer="sgd"), hier=dict(devices_per_node=2)),
    "adam_2x2": dict(model=dict(optimizer="adam"), hier=dict(devices_per_node=2)),
    "adamw_two_groups_scheduler_2x2": dict(
        model=dict(optimizer="adamw_groups", scheduler=True), hier=dict(devices_per_node=2)
    ),
    "weights_3_1": dict(model=dict(optimizer="adam"), hier=dict(devices_per_node=2, slice_weights=[3, 1])),
    "clip_norm_accumulate": dict(
        model=dict(optimizer="sgd"),
        hier=dict(devices_per_node=2),
        trainer=dict(gradient_clip_val=0.05, accumulate_grad_batches=2),
    ),
    "clip_value": dict(
        model=dict(optimizer="sgd"),
        hier=dict(devices_per_node=2),
        trainer=dict(gradient_clip_val=0.01, gradient_clip_algorithm="value"),
    ),
    "frozen_tied_unused_batchnorm": dict(
        model=dict(optimizer="sgd", quirks=True, batch_norm=True),
        hier=dict(devices_per_node=2),
        ddp=dict(find_unused_parameters=True),
    ),
    "one_device_per_node_4x1": dict(model=dict(optimizer="adam"), hier=dict(devices_per_node=1)),
    "one_node_1x4": dict(model=dict(optimizer="sgd"), hier=dict(devices_per_node=4)),
    "time_bucketing_adam": dict(
        model=dict(optimizer="adam"), hier=dict(devices_per_node=2, bucketing=TimeBuckets(profile_steps=2))
    ),
    "time_bucketing_adamw_groups_accumulate_unused": dict(
        model=dict(optimizer="adamw_groups", quirks=True, scheduler=True),
        hier=dict(devices_per_node=2, bucketing=TimeBuckets(profile_steps=1, warmup_steps=0)),
        trainer=dict(accumulate_grad_batches=2),
        ddp=dict(find_unused_parameters=True),
    ),
    "time_bucketing_sgd_weighted_2x2": dict(
        model=dict(optimizer="sgd"),
        hier=dict(devices_per_node=2, slice_weights=[3.0, 1.0], bucketing=TimeBuckets(profile_steps=1)),
    ),
    # the reducer CUDA uses (hooks issue reduce-scatter, stream wait, all-reduce), here on gloo
    "inline_reducer_chunked_adam": dict(
        model=dict(optimizer="adam"),
        hier=dict(devices_per_node=2),
        tuning=dict(_reducer="inline", _comm_chunk_mb=0.001),
    ),
    "inline_reducer_time_bucketing_unused": dict(
        model=dict(optimizer="sgd", quirks=True),
        hier=dict(devices_per_node=2, bucketing=TimeBuckets(profile_steps=1)),
        tuning=dict(_reducer="inline"),
        ddp=dict(find_unused_parameters=True),
    ),
    # lossy by design: the inter-node hop in bf16 with error feedback, against full precision
    "inter_node_bf16_sgd": dict(
        model=dict(optimizer="sgd"), hier=dict(devices_per_node=2, inter_node_dtype="bf16"), tolerance=1e-2
    ),
    # optimizers that look at whole tensors stay whole on every rank (shard_optimizer=None decides so); the
    # gradients still go through the hierarchical reduction
    "adafactor_whole_2x2_unused_clip": dict(
        model=dict(optimizer="adafactor", quirks=True),
        hier=dict(devices_per_node=2),
        trainer=dict(gradient_clip_val=0.05),
        ddp=dict(find_unused_parameters=True),
    ),
    "adafactor_whole_time_bucketing_4x1": dict(
        model=dict(optimizer="adafactor"),
        hier=dict(devices_per_node=1, bucketing=TimeBuckets(profile_steps=1)),
    ),
    "unknown_trust_ratio_whole_1x4_accumulate": dict(
        model=dict(optimizer="trust_ratio_sgd"),
        hier=dict(devices_per_node=4),
        trainer=dict(accumulate_grad_batches=2),
    ),
    "no_bucketing_overlap": dict(
        model=dict(optimizer="sgd"), hier=dict(devices_per_node=2, bucketing="none")
    ),
    "bf16_mixed": dict(
        model=dict(optimizer="adam"), hier=dict(devices_per_node=2), trainer=dict(precision="bf16-mixed")
    ),
    # state made in the optimizer's constructor (Adagrad in torch 2.11 and before) must exist for the slices
    "optimizer_state_made_at_construction": dict(
        model=dict(optimizer="constructed_state_sgd"),
        hier=dict(devices_per_node=2, elementwise_optimizers=["ConstructedStateSGD"]),
    ),
    # nn.Embedding(sparse=True): ddp all-reduces sparse gradients, hier_sliced takes them into its dense
    # buckets (a regression would show as "Cannot access data pointer of Tensor that doesn't have storage")
    "sparse_embedding_sgd": dict(
        model=dict(optimizer="sgd_plain", sparse_embedding=True), hier=dict(devices_per_node=2)
    ),
}


STEP_COUNTS: list[dict[int, float]] = []  # per train(): the optimizer's step count per parameter
PLAN_KINDS: list[str | None] = []
VALIDATED_AT: list[list[int]] = []  # per train(validate=True): the global steps validation ran at


class ValidatedModel(EquivModel):
    """``EquivModel`` with a validation step (a synchronised loss)."""

    def validation_step(self, batch, batch_idx) -> None:  # noqa: ANN001
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self(x), y), sync_dist=True)


class RecordValidations(pl.Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.steps.append(trainer.global_step)


def initial_state(model_kwargs: dict) -> dict:
    pl.seed_everything(1234, verbose=False)
    return {k: v.detach().clone().float() for k, v in EquivModel(**model_kwargs).state_dict().items()}


def train(strategy, model_kwargs: dict, trainer_kwargs: dict, steps: int, validate: bool = False) -> dict:  # noqa: ANN001
    """``validate``: with a validation loader; the steps validation ran at go to ``VALIDATED_AT``."""
    pl.seed_everything(1234, verbose=False)
    model = (ValidatedModel if validate else EquivModel)(**model_kwargs)
    recorder = RecordValidations()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(dist.get_world_size() if dist.is_initialized() else 4),
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
        **trainer_kwargs,
    )
    trainer.fit(model, train_dataloaders=loader(), val_dataloaders=loader() if validate else None)
    if validate:
        VALIDATED_AT.append(recorder.steps)
    plan = getattr(getattr(trainer.strategy, "engine", None), "bucket_plan", None)
    PLAN_KINDS.append(plan.kind if plan is not None else None)
    optimizer_state = trainer.strategy.optimizer_state(trainer.optimizers[0])  # the unsharded layout
    STEP_COUNTS.append({int(i): float(s["step"]) for i, s in optimizer_state["state"].items() if "step" in s})
    return {k: v.detach().clone().float() for k, v in model.state_dict().items()}


def max_rel_diff(a: dict, b: dict) -> float:
    worst = 0.0
    for key in a:
        if key.endswith("num_batches_tracked"):
            continue
        denom = a[key].abs().max().item() + 1e-12
        worst = max(worst, (a[key] - b[key]).abs().max().item() / denom)
    return worst


def main() -> None:
    out = Path(sys.argv[1])
    selected = sys.argv[2].split(",") if len(sys.argv) > 2 else list(SCENARIOS)
    results = {}
    for name in selected:
        spec = SCENARIOS[name]
        trainer_kwargs = spec.get("trainer", {})
        steps = 6 * trainer_kwargs.get("accumulate_grad_batches", 1)
        reference = train(DDPStrategy(**spec.get("ddp", {})), spec["model"], trainer_kwargs, steps)
        hier = tuned(HierSlicedStrategy(bucket_cap_mb=0.002, **spec["hier"]), **spec.get("tuning", {}))
        contender = train(hier, spec["model"], trainer_kwargs, steps)
        moved = max_rel_diff(reference, initial_state(spec["model"]))
        results[name] = {
            "max_rel_diff": max_rel_diff(reference, contender),
            "reference_moved": moved,
            "bucket_plan": PLAN_KINDS[-1],
        }
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
