"""Run under torchrun (4 processes): ``hier_bsp`` in plain-BSP mode against Lightning's ``ddp``.

``superstep=1, max_staleness=0`` applies every worker's gradient of each optimizer step
together, so the parameters must equal ``ddp``'s. Rank 0 writes ``{scenario: {"max_rel_diff": ...,
"reference_moved": ..., "supersteps": ...}}`` to the path in argv[1].
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from models import built  # noqa: E402
from train_equivalence import STEP_COUNTS, VALIDATED_AT, initial_state, max_rel_diff, train  # noqa: E402

from lightning_hier import HierBSPStrategy, TimeBuckets  # noqa: E402

SCENARIOS: dict[str, dict] = {
    "sgd_momentum_2x2": dict(model=dict(optimizer="sgd"), bsp=dict(devices_per_node=2, _early_push=True)),
    "adam_4x1": dict(model=dict(optimizer="adam"), bsp=dict(devices_per_node=1, _early_push=True)),
    "adamw_groups_scheduler_clip_norm_accumulate": dict(
        model=dict(optimizer="adamw_groups", scheduler=True),
        bsp=dict(devices_per_node=2, _early_push=True),
        trainer=dict(gradient_clip_val=0.05, accumulate_grad_batches=2),
    ),
    # a never-used Linear, a frozen one and a tied pair; SGD's weight decay would move the unused one
    "sgd_weight_decay_frozen_tied_unused": dict(
        model=dict(optimizer="sgd", quirks=True),
        # ddp's own keyword, as a config written for ddp passes it: accepted, and the result is ddp's
        bsp=dict(devices_per_node=2, _early_push=True, find_unused_parameters=True),
        ddp=dict(find_unused_parameters=True),
    ),
    # used in every third step only, in one bucket with always-used parameters: Adam's step count of
    # its own must advance only when it is used, as under ddp
    "adam_partly_used_one_bucket": dict(
        model=dict(optimizer="adam", partly_used=True),
        bsp=dict(devices_per_node=2, bucket_cap_mb=25, _early_push=True),
        ddp=dict(find_unused_parameters=True),
    ),
    # state made in the optimizer's constructor (Adagrad in torch 2.11 and before) must exist for the pieces
    # optimizers that read whole tensors, stepped on a whole-parameter server (devices_per_node=1): Adafactor
    # (factored moments per matrix) with a never-used, a frozen and a tied parameter; an unknown LARS-like
    # trust ratio with accumulation and clipping
    "adafactor_whole_server_frozen_tied_unused": dict(
        model=dict(optimizer="adafactor", quirks=True),
        bsp=dict(devices_per_node=1, _early_push=True, find_unused_parameters=True),
        ddp=dict(find_unused_parameters=True),
    ),
    "trust_ratio_whole_server_accumulate_clip": dict(
        model=dict(optimizer="trust_ratio_sgd"),
        bsp=dict(devices_per_node=1, _early_push=True),
        trainer=dict(gradient_clip_val=0.05, accumulate_grad_batches=2),
    ),
    "optimizer_state_made_at_construction": dict(
        model=dict(optimizer="constructed_state_sgd"),
        bsp=dict(devices_per_node=2, _early_push=True, elementwise_optimizers=["ConstructedStateSGD"]),
    ),
    # buckets rebuilt from gradient-ready times after 1 + 2 micro-steps (one bucket by size before)
    "sgd_time_buckets": dict(
        model=dict(optimizer="sgd"),
        bsp=dict(
            devices_per_node=2,
            bucket_cap_mb=25,
            bucketing=TimeBuckets(profile_steps=2, warmup_steps=1, min_bucket_mb=0),
        ),
    ),
    # BatchNorm's running statistics: every worker updates its own; rank 0's everywhere once drained (SGD:
    # the bias before a BatchNorm gets a gradient of float noise, which Adam would blow up to full steps)
    "sgd_batch_norm": dict(
        model=dict(optimizer="sgd", batch_norm=True), bsp=dict(devices_per_node=2, _early_push=True)
    ),
    "sparse_embedding_sgd": dict(
        model=dict(optimizer="sgd_plain", sparse_embedding=True),
        bsp=dict(devices_per_node=2, _early_push=True),
    ),
    # max_steps mid-epoch (8 batches per worker) with validation every 4 steps: ddp validates at step 4
    # only; lockstep workers must not add the epoch-end validation that free-running ones take at max_steps
    "sgd_max_steps_mid_epoch_validation": dict(
        model=dict(optimizer="sgd"),
        bsp=dict(devices_per_node=2, _early_push=True),
        trainer=dict(val_check_interval=4, num_sanity_val_steps=0),
        validate=True,
    ),
    # validation every 2 batches inside 3-batch accumulation windows: every worker drains with its micro-step
    # in flight (a regression would show as the drain waiting for that worker's own fold until the timeout)
    "sgd_validation_inside_accumulation_window": dict(
        model=dict(optimizer="sgd"),
        bsp=dict(devices_per_node=2, _early_push=True),
        trainer=dict(accumulate_grad_batches=3, val_check_interval=2, num_sanity_val_steps=0),
        validate=True,
    ),
    "sgd_clip_value_no_early_push": dict(
        model=dict(optimizer="sgd"),
        bsp=dict(devices_per_node=2),  # _early_push=None: off on CPU
        trainer=dict(gradient_clip_val=0.01, gradient_clip_algorithm="value"),
    ),
}


def main() -> None:
    out = Path(sys.argv[1])
    results = {}
    for name, spec in SCENARIOS.items():
        trainer_kwargs = spec.get("trainer", {})
        steps = 6
        validate = spec.get("validate", False)
        reference = train(DDPStrategy(**spec.get("ddp", {})), spec["model"], trainer_kwargs, steps, validate)
        settings = {"bucket_cap_mb": 0.002, **spec["bsp"]}
        strategy = built(HierBSPStrategy, superstep=1, max_staleness=0, **settings)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = train(strategy, spec["model"], trainer_kwargs, steps, validate)
        every_rank: list = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, state)
        results[name] = {
            "max_rel_diff": max_rel_diff(reference, state),
            # parameters and buffers (BatchNorm's statistics included) after the fit's final drain
            "differs_across_ranks": max(max_rel_diff(every_rank[0], other) for other in every_rank),
            "reference_moved": max_rel_diff(reference, initial_state(spec["model"])),
            "supersteps": len(strategy.superstep_records),
            # per parameter, as the unsharded optimizer's state_dict has them: ddp's, then hier_bsp's
            "step_counts": {str(k): v for k, v in STEP_COUNTS[-2].items()},
            "step_counts_bsp": {str(k): v for k, v in STEP_COUNTS[-1].items()},
            "micro_steps": [r.micro_steps for r in strategy.superstep_records],
            # the global steps validation ran at, under ddp and under hier_bsp (validated scenarios)
            "validated_at": VALIDATED_AT[-2:] if validate else None,
            "ready_buckets": [r.ready_buckets for r in strategy.superstep_records],
            "buckets": len(strategy.engine.buckets),
            "supersteps_before_rebuild": len(strategy._earlier_records),
            "time_plan": strategy.time_plan.to_dict() if strategy.time_plan is not None else None,
            "scheduler_before_optimizer_warnings": sum(
                "before `optimizer.step()`" in str(w.message) for w in caught
            ),
        }
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
