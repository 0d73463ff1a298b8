"""Run under torchrun on one CUDA device (NCCL, world size 1): every strategy against Lightning.

``gpu_checks.py OUT [CASE,...]`` trains each case on the GPU twice, once under the package's strategy
and once under Lightning's own (``ddp`` on the same device, or the single-device strategy for the
pipeline), and writes ``{case: {"max_rel_diff": ..., "reference_moved": ...}}`` as JSON to OUT.
``tests/test_gpu.py`` runs it where a GPU exists (CI has none) and checks the numbers. With one
device the NCCL collectives are trivial, but they are real: NCCL refuses host tensors, the CUDA
code paths (inline reducer, CUDA-event step clock, pinned swap, the sharded grad scaler) run, and
``LIGHTNING_HIER_AUDIT_DIR`` records what was issued.

Two settings make the one device check more than a one-rank run can show by itself:
``LIGHTNING_HIER_FORCE_COLLECTIVES=1`` issues the collectives of one-rank groups that training skips
(every reduce-scatter, all-reduce and all-gather really runs on an NCCL communicator, with its stream
waits and events), and ``LIGHTNING_HIER_SYNC_CHECK=1`` turns torch's sync debug mode to ``"error"`` from
the third training batch to the end of every fit under the package's strategies, so a host-device
synchronisation in a steady-state step raises where it happens (hier_bsp's module thread waits on its own
stream by design and is left out). Run them under ``TORCH_CUDA_SANITIZER=1`` as well, which reports
accesses to one tensor from two streams without synchronisation.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
from hybrid_checks import Click  # noqa: E402
from hybrid_checks import loader as hybrid_loader  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy  # noqa: E402
from models import EquivModel, built, loader  # noqa: E402
from pipeline_models import LitAutoEncoder, SkewedNet, WrapperNet  # noqa: E402
from pipeline_models import loader as pipeline_loader  # noqa: E402

from lightning_hier import (  # noqa: E402
    CommProfiler,
    HierBSPStrategy,
    HierPipelineStrategy,
    HierSlicedStrategy,
    TimeBuckets,
)
from lightning_hier.audit import start_from_env  # noqa: E402
from lightning_hier.bsp.stream_handoff import StreamHandoff  # noqa: E402
from lightning_hier.profiling.comm_stats import CommStats  # noqa: E402

SLICED = {
    "sliced_sgd_size": (dict(optimizer="sgd", quirks=True, batch_norm=True), {}, {}),
    "sliced_adam_time": (dict(optimizer="adam"), dict(bucketing=TimeBuckets(profile_steps=2)), {}),
    "sliced_adamw_none_clip": (
        dict(optimizer="adamw_groups", scheduler=True),
        dict(bucketing="none"),
        dict(gradient_clip_val=0.05),
    ),
    "sliced_bf16_mixed": (dict(optimizer="adam"), {}, dict(precision="bf16-mixed")),
    "sliced_16_mixed": (dict(optimizer="adam"), {}, dict(precision="16-mixed")),
    "sliced_accumulate_thread_reducer": (
        dict(optimizer="sgd"),
        dict(_reducer="thread"),
        dict(accumulate_grad_batches=2),
    ),
    # optimizers that read whole tensors stay whole on every rank (factored moments; a trust ratio)
    "sliced_adafactor_whole": (dict(optimizer="adafactor", quirks=True), {}, {}),
    "sliced_trust_ratio_whole_clip": (dict(optimizer="trust_ratio_sgd"), {}, dict(gradient_clip_val=0.05)),
}
PIPELINE = {
    "pipeline_keep": dict(activation_policy="keep"),
    # steps that call a submodule themselves (forward hands its input on): run as self(...) on the stage
    "pipeline_delegating_wrapper": dict(activation_policy="keep"),
    "pipeline_lightning_autoencoder": dict(activation_policy="keep"),
    "pipeline_swap": dict(activation_policy="swap"),
    "pipeline_recompute_gpipe": dict(activation_policy="recompute", schedule="gpipe"),
    # every micro-batch timed per layer with CUDA events, cut specs kept from memory
    "pipeline_timed_static_shapes": dict(activation_policy="keep", static_shapes=True),
}
HYBRID = {"hybrid_adagrad_16_mixed": "16-mixed", "hybrid_sgd_32": "32-true"}
# plain BSP (superstep=1, max_staleness=0) applies each step's gradients together: ddp's result
BSP = {
    "bsp_plain_sgd_early_push": (dict(optimizer="sgd"), dict(_early_push=True), {}),
    "bsp_plain_adamw_clip_accumulate": (
        dict(optimizer="adamw_groups", scheduler=True),
        {},
        dict(gradient_clip_val=0.05, accumulate_grad_batches=2),
    ),
    "bsp_plain_bf16_mixed": (dict(optimizer="adam"), {}, dict(precision="bf16-mixed")),
    "bsp_plain_time_buckets": (dict(optimizer="sgd"), dict(bucketing=TimeBuckets(profile_steps=2)), {}),
    # Adafactor's factored moments need whole parameters: the whole-parameter server (devices_per_node=1)
    "bsp_plain_adafactor_whole_server": (dict(optimizer="adafactor"), dict(devices_per_node=1), {}),
    # the worker's stream held back on the device: the local BSP module's own stream must wait for folds
    "bsp_lagging_worker_stream": (dict(optimizer="adam"), dict(_early_push=True), {}),
    # the same with the module's waits removed: must NOT match (the check above can fail on a GPU)
    "bsp_lagging_unordered": (dict(optimizer="adam"), dict(_early_push=True), {}),
    # four micro-steps per superstep in lockstep: ddp accumulating four batches
    "bsp_superstep4_lockstep": (
        dict(optimizer="adam"),
        dict(superstep=4),
        dict(accumulate_grad_batches=4),
    ),
}
# hier_bsp's defaults (superstep=4, max_staleness=1): the worker runs ahead of the server, so no
# reference run matches it; every micro-step computed must be applied, none staler than one superstep
BSP_ASYNC = ("bsp_default_async",)
NEGATIVE_CONTROLS = ("bsp_lagging_unordered",)
# CommProfiler on CUDA tensors (CUDA-event timing): the profiled fit against the same fit without it
PROFILED = ("profiler_ddp", "profiler_hier_sliced", "profiler_hier_bsp", "profiler_hier_pipeline")
RESUMED = ("sliced_checkpoint_resume",)  # a checkpoint of a CUDA run, resumed on the device
PIPELINE_MODELS = {
    "pipeline_delegating_wrapper": WrapperNet,
    "pipeline_lightning_autoencoder": LitAutoEncoder,
}


class NoSyncInSteadySteps(pl.Callback):
    """From the third training batch on, any host-device synchronisation raises (torch's sync debug mode);
    validation, checkpoints and the fit's end are outside and may synchronise."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_step >= 2:
            torch.cuda.set_sync_debug_mode("error")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        torch.cuda.set_sync_debug_mode("default")

    def on_exception(self, trainer, pl_module, exception) -> None:  # noqa: ANN001
        torch.cuda.set_sync_debug_mode("default")


def trainer(strategy, steps: int, **kwargs) -> pl.Trainer:  # noqa: ANN001, ANN003
    checked = isinstance(strategy, (HierSlicedStrategy, HierPipelineStrategy))
    if checked and os.environ.get("LIGHTNING_HIER_SYNC_CHECK") == "1":
        kwargs["callbacks"] = [*kwargs.get("callbacks", []), NoSyncInSteadySteps()]
    return pl.Trainer(
        accelerator="gpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}


def max_rel_diff(a: dict, b: dict) -> float:
    worst = 0.0
    for key in a:
        if key.endswith("num_batches_tracked"):
            continue
        worst = max(worst, ((a[key] - b[key]).abs().max() / (a[key].abs().max() + 1e-12)).item())
    return worst


class LaggingModel(EquivModel):
    """``EquivModel`` whose every step first queues ~20 ms of sleep on the device: the host runs ahead of
    the worker's stream, so anything read on another stream without waiting sees values not yet
    computed."""

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        torch.cuda._sleep(40_000_000)
        return super().training_step(batch, batch_idx)


def against_ddp(
    ddp: DDPStrategy,
    contender: object,
    model_kwargs: dict,
    trainer_kwargs: dict,
    model_class: type = EquivModel,
    accumulating_contender: bool = False,
) -> dict:
    """``model_class`` trained for 6 optimizer steps under ``ddp`` and under ``contender``; an
    ``accumulating_contender`` (hier_bsp's supersteps) gathers the micro-steps itself, without
    Lightning's ``accumulate_grad_batches``, and counts each micro-step as a step."""
    accumulate = trainer_kwargs.get("accumulate_grad_batches", 1)
    results, optimizer_states = [], []
    for strategy in (ddp, contender):
        pl.seed_everything(1234, verbose=False)
        model = model_class(**model_kwargs)
        initial = state(model)
        steps, own_kwargs = 6 * accumulate, trainer_kwargs
        if accumulating_contender:  # ddp takes 6 optimizer steps of 4 batches, the contender 24 micro-steps
            steps = 6 * accumulate if strategy is contender else 6
            if strategy is contender:
                own_kwargs = {k: v for k, v in trainer_kwargs.items() if k != "accumulate_grad_batches"}
        fitted = trainer(strategy, steps, **own_kwargs)
        fitted.fit(model, loader())
        results.append(state(model))
        optimizer_states.append(optimizer_state(fitted))
    return {
        "max_rel_diff": max_rel_diff(results[0], results[1]),
        "reference_moved": max_rel_diff(results[0], initial),
        # the optimizer as the fit leaves it (hier_sliced gives it back whole, as ddp leaves it)
        "optimizer_state_rel_diff": (
            max_rel_diff(optimizer_states[0], optimizer_states[1])
            if optimizer_states[0].keys() == optimizer_states[1].keys()
            else float("inf")
        ),  # fmt: skip
    }


def optimizer_state(fitted: pl.Trainer) -> dict[str, torch.Tensor]:
    """The first optimizer's per-parameter tensors after the fit, keyed by parameter index and name."""
    saved = fitted.optimizers[0].state_dict()["state"]
    return {
        f"{index}.{name}": value.detach().float().cpu().reshape(-1).clone()
        for index, entry in saved.items()
        for name, value in entry.items()
        if torch.is_tensor(value) and value.dim() > 0
    }


def resumed(case: str) -> dict:
    """hier_sliced fits one epoch, checkpoints, and a new Trainer resumes it to two on the same device:
    the parameters against ddp's uninterrupted two epochs."""
    directory = Path(sys.argv[1]).parent / case
    results = []
    for strategy in ("ddp", "hier_sliced"):
        pl.seed_everything(1234, verbose=False)
        model = EquivModel(optimizer="adam", scheduler=True)
        initial = state(model)
        if strategy == "ddp":
            trainer(DDPStrategy(), -1, max_epochs=2).fit(model, loader())
        else:
            first = trainer(HierSlicedStrategy(bucket_cap_mb=0.002), -1, max_epochs=1)
            first.fit(model, loader())
            first.save_checkpoint(directory / "epoch1.ckpt")
            pl.seed_everything(1234, verbose=False)
            model = EquivModel(optimizer="adam", scheduler=True)
            trainer(HierSlicedStrategy(bucket_cap_mb=0.002), -1, max_epochs=2).fit(
                model, loader(), ckpt_path=str(directory / "epoch1.ckpt")
            )
        results.append(state(model))
    return {
        "max_rel_diff": max_rel_diff(results[0], results[1]),
        "reference_moved": max_rel_diff(results[0], initial),
    }


def sliced(case: str) -> dict:
    model_kwargs, hier_kwargs, trainer_kwargs = SLICED[case]
    contender = built(HierSlicedStrategy, bucket_cap_mb=0.002, **hier_kwargs)
    return against_ddp(DDPStrategy(find_unused_parameters=True), contender, model_kwargs, trainer_kwargs)


class TimeEveryLayer(pl.Callback):
    """Every micro-batch timed per layer, as rebalancing or ``partition="time"`` would time some."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.engine.layer_timing = "all"


def pipeline(case: str) -> dict:
    """One stage in 4 micro-batches against Lightning on one device accumulating the same 4 micro-batches
    (the same matrix shapes and summation order). Against whole batches the kernels differ, and Adam's
    update turns those float differences of near-zero gradients into ~1e-4 (``max_rel_diff_whole_batch``)."""
    results = []
    device = torch.device("cuda", 0)
    timed = [TimeEveryLayer()] if "timed" in case else []
    runs = (
        (SingleDeviceStrategy(device=device), dict(accumulate_grad_batches=4), 8),
        (SingleDeviceStrategy(device=device), {}, 32),
        (HierPipelineStrategy(micro_batches=4, rebalance="never", **PIPELINE[case]), {}, 32),
    )
    synchronizes = [0]
    synchronize = torch.cuda.synchronize

    def counted(*args: object, **kwargs: object) -> None:
        synchronizes[0] += 1
        synchronize(*args, **kwargs)

    for strategy, trainer_kwargs, batch_size in runs:
        pl.seed_everything(0, verbose=False)
        model = PIPELINE_MODELS.get(case, SkewedNet)(optimizer="adam")
        initial = state(model)
        pipelined = isinstance(strategy, HierPipelineStrategy)
        callbacks = timed if pipelined else []
        # the pipeline's fit: how often the host waited for the whole device (timing must not, per step)
        with mock.patch.object(torch.cuda, "synchronize", counted) if pipelined else contextlib.nullcontext():
            trainer(strategy, 6, callbacks=callbacks, **trainer_kwargs).fit(
                model, pipeline_loader(batch_size=batch_size)
            )
        results.append(state(model))
    executor = runs[-1][0].engine.executor
    executor.resolve()  # the last steps' marks may still be pending (read once the device passed them)
    return {
        "max_rel_diff": max_rel_diff(results[0], results[2]),
        "reference_moved": max_rel_diff(results[0], initial),
        "max_rel_diff_whole_batch": max_rel_diff(results[1], results[2]),
        # {layer: [forward ms, backward ms]} as the stage's CUDA events measured them
        "layer_times_ms": {
            str(i): [1e3 * f, 1e3 * b] for i, (f, b) in executor.times.summary(executor.layer_range).items()
        },
        "layers": len(executor.layer_range),
        "steps": 6,
        "synchronizes_in_fit": synchronizes[0],
    }


def hybrid(case: str) -> dict:
    """HybridEmbedding (host table, CUDA ids) under hier_sliced against a dense EmbeddingBag under ddp."""
    results = []
    for use_hybrid in (False, True):
        strategy = HierSlicedStrategy() if use_hybrid else DDPStrategy()
        pl.seed_everything(0, verbose=False)
        model = Click(hybrid=use_hybrid, optimizer="adagrad" if "adagrad" in case else "sgd")
        if not use_hybrid:
            initial = {"emb": model.emb.weight.detach().float().cpu().clone(), **state(model.head)}
        trainer(strategy, 8, precision=HYBRID[case], use_distributed_sampler=False).fit(
            model, hybrid_loader()
        )
        results.append({"emb": model.emb.weight.detach().float().cpu().clone(), **state(model.head)})
    return {
        "max_rel_diff": max_rel_diff(results[0], results[1]),
        "reference_moved": max_rel_diff(results[0], initial),
    }


def bsp(case: str) -> dict:
    model_kwargs, bsp_kwargs, trainer_kwargs = BSP[case]
    contender = built(
        HierBSPStrategy, **{"superstep": 1, "max_staleness": 0, "bucket_cap_mb": 0.002, **bsp_kwargs}
    )
    lagging = "lagging" in case
    unordered = (
        mock.patch.object(StreamHandoff, "module_takes_over", lambda self: None)
        if case in NEGATIVE_CONTROLS else contextlib.nullcontext()
    )  # fmt: skip
    with unordered:
        result = against_ddp(
            DDPStrategy(),
            contender,
            model_kwargs,
            trainer_kwargs,
            LaggingModel if lagging else EquivModel,
            accumulating_contender=contender.settings.superstep_steps > 1,
        )
    records = contender.superstep_records
    return {
        **result,
        "supersteps": len(records),
        "early_buckets": sum(r.early_buckets for r in records),
        "rebuilt_on_time_plan": contender.time_plan is not None,
    }


def bsp_async(case: str) -> dict:
    """hier_bsp with its defaults on the device: 24 micro-steps, every one applied, staleness bounded."""
    pl.seed_everything(1234, verbose=False)
    model = EquivModel(optimizer="adam")
    initial = state(model)
    strategy = HierBSPStrategy(bucket_cap_mb=0.002)
    fitted = trainer(strategy, 24)
    fitted.fit(model, loader())
    records = strategy.superstep_records
    return {
        "computed": fitted.global_step,
        "applied": sum(sum(r.micro_steps) for r in records),
        "staleness_seen": max(max(r.staleness_counts) for r in records),
        "max_staleness": strategy.settings.max_staleness,
        "supersteps": len(records),
        "reference_moved": max_rel_diff(state(model), initial),
        "finite": all(torch.isfinite(v).all().item() for v in state(model).values()),
    }


ISSUED: list[bool] = []  # per operation the profiler saw: whether it timed it with CUDA events


def _record_issue(original):  # noqa: ANN001, ANN202
    def issue(self, name, kind, nbytes, wire, cuda):  # noqa: ANN001, ANN202
        ISSUED.append(bool(cuda))
        return original(self, name, kind, nbytes, wire, cuda)

    return issue


CommStats._issue = _record_issue(CommStats._issue)


def _profiled_strategy(case: str):  # noqa: ANN202
    if case == "profiler_ddp":
        return DDPStrategy()
    if case == "profiler_hier_sliced":
        return HierSlicedStrategy()
    if case == "profiler_hier_pipeline":
        return HierPipelineStrategy(micro_batches=2)
    return HierBSPStrategy(superstep=1, max_staleness=0)


def profiled(case: str) -> dict:
    """The same fit with and without CommProfiler; what the profiler measured on the CUDA clock."""
    steps = 6
    results = []
    ISSUED.clear()
    for with_profiler in (False, True):
        pl.seed_everything(0, verbose=False)
        model = EquivModel(optimizer="adam")
        initial = state(model)
        # every step timed (hier_pipeline's default times every 10th): the CUDA-event path on each one
        profiler = CommProfiler(
            output_dir=str(Path(sys.argv[1]).parent / case), log_every_n_steps=1, time_every_n_steps=1
        )
        callbacks = [profiler] if with_profiler else []
        trainer(_profiled_strategy(case), steps, callbacks=callbacks).fit(model, loader())
        results.append(state(model))
    stats = profiler.stats
    assert stats is not None
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {
        "max_rel_diff": max_rel_diff(results[0], results[1]),
        "reference_moved": max_rel_diff(results[0], initial),
        "param_bytes": param_bytes,
        "events": len(ISSUED),
        "cuda_events": sum(ISSUED),
        "steps": [
            {
                "step_ms": 1e3 * step.step_s,
                "kinds": {
                    kind: [k.count, k.nbytes, 1e3 * k.time_s, 1e3 * k.exposed_s]
                    for kind, k in step.kinds.items()
                },
            }
            for step in stats.steps
        ],
        "outside": {kind: [k.count, k.nbytes] for kind, k in stats.outside.items()},
        "csv_written": bool(profiler.csv_path and profiler.csv_path.exists()),
        "unobserved_completions": stats.unobserved_completions,
    }


def main() -> None:
    out = Path(sys.argv[1])
    start_from_env()  # LIGHTNING_HIER_AUDIT_DIR: the Lightning runs before the first strategy's setup too
    every = [*SLICED, *RESUMED, *PIPELINE, *HYBRID, *BSP, *BSP_ASYNC, *PROFILED]
    cases = sys.argv[2].split(",") if len(sys.argv) > 2 else every
    results: dict = {}
    for case in cases:
        run = (
            sliced if case in SLICED else pipeline if case in PIPELINE else bsp if case in BSP
            else bsp_async if case in BSP_ASYNC
            else profiled if case in PROFILED else resumed if case in RESUMED else hybrid
        )  # fmt: skip
        try:
            results[case] = run(case)
        except Exception as error:  # noqa: BLE001 - one broken case must not hide the others
            import traceback

            results[case] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}
        print(case, json.dumps({k: v for k, v in results[case].items() if k != "trace"}), flush=True)
    if not dist.is_initialized() or dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
