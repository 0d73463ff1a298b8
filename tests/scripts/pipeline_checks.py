"""Run under torchrun: train pipeline_models.SkewedNet under hier_pipeline; rank 0 reports.

    pipeline_checks.py SCENARIO OUT_JSON WORKDIR

Rank 0 writes JSON with the per-step losses, the rebalance history and the path of a final
checkpoint (consolidated, loadable without the strategy); the test compares them with a
single-process Lightning run of the same module.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import BasePredictionWriter, ModelCheckpoint  # noqa: E402
from pipeline_models import (  # noqa: E402
    MODELS,
    SkewedNet,
    dataset,
    flagged_loader,
    gain_loader,
    loader,
    token_loader,
)
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_hier import HierPipelineStrategy, Rebalance, StageRebalancer  # noqa: E402

# a check every 2 steps that re-splits on any predicted gain: the lopsided starts below must migrate
EAGER = Rebalance(every=2, imbalance_threshold=0.01, min_gain=0.0)

SCENARIOS: dict[str, dict] = {
    # 4 stages, a deliberately lopsided start (3 tiny stages, everything else on the last one)
    "rebalance_adam_1f1b": dict(
        model=dict(optimizer="adam"),
        strategy=dict(partition=[1, 1, 1, 17], rebalance=2, micro_batches=4),
        tuning=dict(_split_backward=True),
        # float64: Adam turns float32 summation-order noise (micro-batches vs one batch) into
        # 1e-4-relative differences on a few elements on some CPUs; in float64 that noise is gone and
        # any real error in migration still shows at full size
        trainer=dict(max_steps=8, precision="64-true"),
        rebalancer=True,
    ),
    "shared_modules_migrate": dict(
        model=dict(optimizer="adam"),
        model_class="twice",
        strategy=dict(partition=[1, 1, 1, 14], rebalance=2, micro_batches=4, split_tied_parameters=False),
        trainer=dict(max_steps=6, precision="64-true"),
    ),
    # the same model with layers that share parameters split over stages (replicas, gradients summed),
    # migrating every 2 steps, clipped by the global norm
    "tied_split_migrate": dict(
        model=dict(optimizer="adam"),
        model_class="twice",
        strategy=dict(partition=[1, 1, 1, 28], rebalance=2, micro_batches=4),
        tuning=dict(_split_backward=True),
        trainer=dict(max_steps=8, precision="64-true", gradient_clip_val=0.5),
    ),
    # dropout on every stage, layers migrating every 2 steps, against the same pipeline on one stage
    # enc on stage 0 (rank 1), dec tied to it on stage 1 (rank 0); rank 1 built other values for it
    "tied_split_apart_at_start": dict(
        model=dict(optimizer="adam"),
        model_class="twice",
        strategy=dict(partition=["dec"], rebalance="never", micro_batches=4),
        trainer=dict(max_steps=4, precision="64-true"),
        tied_apart_off_rank0=True,
    ),
    # a tied-embedding language model over 3 stages (the embedding's replicas on the first and last),
    # migrating every 2 steps, clipped
    "gpt_tied_3_stages": dict(
        model=dict(optimizer="adamw"),
        model_class="gpt",
        # lopsided start (the last stage holds 7 of 9 clusters): the step-2 check must move blocks
        strategy=dict(partition=[1, 1, 7], rebalance=EAGER),
        trainer=dict(max_steps=6, precision="64-true", gradient_clip_val=1.0),
    ),
    "dropout_migrate": dict(
        model=dict(optimizer="adam"),
        model_class="drop",
        strategy=dict(partition="uniform", rebalance=EAGER),
        trainer=dict(max_steps=6, precision="64-true"),
    ),
    "dropout_one_stage": dict(
        model=dict(optimizer="adam"),
        model_class="drop",
        strategy=dict(partition="uniform", rebalance="never"),
        trainer=dict(max_steps=6, precision="64-true"),
    ),
    # self.all_gather in the steps (which only the last stage runs) and in an epoch-end hook
    "all_gather": dict(
        model=dict(optimizer="adam"),
        model_class="gather",
        strategy=dict(partition="uniform", rebalance="never", micro_batches=1),
        trainer=dict(max_epochs=1, limit_train_batches=3, limit_val_batches=2),
        validate=True,
    ),
    "gpipe_sgd_clip_accumulate": dict(
        model=dict(optimizer="sgd"),
        strategy=dict(partition="uniform", schedule="gpipe", rebalance=3, micro_batches=3),
        tuning=dict(_split_backward=True),
        trainer=dict(max_steps=4, gradient_clip_val=0.05, accumulate_grad_batches=2),
    ),
    "resume_first_2_stages": dict(
        model=dict(optimizer="adam"),
        strategy=dict(partition=[2, 18], rebalance=1, micro_batches=2),
        trainer=dict(max_steps=3, limit_train_batches=3),
    ),
    "resume_then_4_stages": dict(
        model=dict(optimizer="adam"),
        strategy=dict(partition="parameters", rebalance="never", micro_batches=4),
        trainer=dict(max_steps=6, limit_train_batches=3),
        resume="resume_first_2_stages",
    ),
    "validate_predict_monitor": dict(
        model=dict(optimizer="adam"),
        model_class="epoch_logging",
        # static_shapes: validation and predict remember their own cut specs beside training's
        strategy=dict(partition="time", profile_steps=2, micro_batches=2, static_shapes=True),
        trainer=dict(max_epochs=2, limit_train_batches=4, limit_val_batches=2),
        monitor=True,
    ),
    "top_k_improving": dict(
        model=dict(optimizer="adam"),
        strategy=dict(partition="uniform", micro_batches=2, rebalance="never"),
        trainer=dict(max_epochs=5, limit_train_batches=4, limit_val_batches=2),
        top_k=2,
    ),
    "crash_during_migration": dict(
        model=dict(optimizer="adam"),
        strategy=dict(partition=[1, 19], rebalance=3, micro_batches=2, timeout=timedelta(seconds=20)),
        trainer=dict(max_steps=6, limit_train_batches=2),
        crash_stage=1,
        every_step_checkpoint=True,
    ),
    "memory_cap": dict(
        model=dict(optimizer="adam"),
        strategy=dict(partition="uniform", rebalance="never", micro_batches=4, profile_steps=2),
        tuning=dict(_split_backward=True),
        trainer=dict(max_steps=5, precision="64-true"),  # float64: see rebalance_adam_1f1b
        memory_probe=True,
        rebalancer=True,
    ),
    "recompute_everything": dict(
        model=dict(optimizer="sgd"),
        strategy=dict(partition="uniform", rebalance=2, micro_batches=4, activation_policy="recompute"),
        trainer=dict(max_steps=5),
    ),
    "memory_limit_too_small": dict(
        model=dict(optimizer="adam"),
        strategy=dict(
            partition="uniform", rebalance="never", micro_batches=4, profile_steps=1, memory_limit=1
        ),
        trainer=dict(max_steps=3),
    ),
    "shuffled_loader_with_dropout": dict(
        model=dict(optimizer="adam", dropout=0.3),
        strategy=dict(partition="uniform", rebalance="never", micro_batches=2),
        trainer=dict(max_epochs=3, limit_train_batches=3),
        shuffle=True,
    ),
    # cut specs remembered per micro-batch shape: a smaller last batch (256 = 5 x 48 + 16) brings new
    # shapes, migrations move the cuts (specs forgotten), validation adds its own
    "static_shapes_migrate": dict(
        model=dict(optimizer="adam"),
        strategy=dict(partition=[1, 19], rebalance=2, micro_batches=3, static_shapes=True),
        trainer=dict(max_epochs=2, precision="64-true"),
        batch_size=48,
    ),
    # the first stage runs every forward before its first backward (2 extra warm-up forwards), its
    # surplus activations received ahead by the second, with cut specs remembered per shape
    "extra_warmup_static": dict(
        model=dict(optimizer="adam"),
        strategy=dict(partition=[12, 8], rebalance="never", micro_batches=4, static_shapes=True),
        tuning=dict(_extra_warmup=2),
        trainer=dict(max_epochs=2, precision="64-true"),
        batch_size=48,
    ),
    # one Linear on three stages: two of them hold a relay layer only, across a validation and a resume
    "relay_stages": dict(
        model=dict(optimizer="sgd"),
        model_class="one",
        strategy=dict(micro_batches=2),
        trainer=dict(max_epochs=2, limit_train_batches=3, limit_val_batches=2),
        validate=True,
    ),
    # training_step returning None for whole micro-batches, and an overridden LightningModule.backward
    "skipped_micro_batches_custom_backward": dict(
        model=dict(optimizer="sgd"),
        model_class="skipping",
        strategy=dict(partition="uniform", rebalance="never", micro_batches=2),
        trainer=dict(max_steps=5),
        flagged=True,
    ),
    # forward(x, gain): a further input read by layers on every stage (bound from each stage's own
    # call of forward), on three stages with a rebalance moving layers
    "further_input_three_stages": dict(
        model=dict(optimizer="sgd"),
        model_class="gain",
        strategy=dict(partition="uniform", rebalance=2, micro_batches=2),
        trainer=dict(max_steps=6, precision="64-true"),
        gain=True,
    ),
    # one process: whole steps skipped as well (Lightning allows that only there)
    "skipped_steps_one_stage": dict(
        model=dict(optimizer="sgd", skip_every=3),
        model_class="skipping",
        strategy=dict(partition="uniform", rebalance="never", micro_batches=2),
        trainer=dict(max_steps=5),
        flagged=True,
    ),
    # training_step(dataloader_iter) on three stages (the middle one pulls its batches too), returning
    # an extra key that must reach on_train_batch_end
    "dataloader_iter_three_stages": dict(
        model=dict(optimizer="adam"),
        model_class="iter",
        strategy=dict(partition="uniform", rebalance="never"),
        trainer=dict(max_steps=5),
    ),
    # the last stage's training_step sets should_stop (after step 3 of an 8-step epoch, 3 epochs): every
    # stage stops with it
    "stop_in_training_step": dict(
        model=dict(optimizer="sgd"),
        model_class="stopping",
        strategy=dict(partition="uniform", rebalance="never", micro_batches=2),
        trainer=dict(max_epochs=3),
    ),
    # torch.compile'd blocks (opaque layers) migrating between stages
    "compiled_blocks_migrate": dict(
        model=dict(optimizer="sgd"),
        model_class="compiled_blocks",
        strategy=dict(partition=[1, 11], rebalance=2, micro_batches=2),
        trainer=dict(max_steps=6),
    ),
    # the whole module torch.compile'd before fit (Lightning compiles forward and the *_step methods;
    # aot_eager goes through the same AOT autograd that would fail inside the stage exchange)
    "compiled_module": dict(
        model=dict(optimizer="sgd"),
        strategy=dict(partition="uniform", rebalance="never", micro_batches=2),
        trainer=dict(max_steps=4),
        compile_module="aot_eager",
    ),
    # a buffer updated in forward, and configure_optimizers reading estimated_stepping_batches (before the
    # strategy's setup); an unshuffled loader, so Lightning's DistributedSampler would reorder it
    "counting_scheduled": dict(
        model=dict(optimizer="sgd"),
        model_class="counting_scheduled",
        strategy=dict(partition="uniform", rebalance="never", micro_batches=2),
        trainer=dict(max_epochs=1),  # with max_steps alone Lightning estimates without loading the data
    ),
    # each process reads its own shard (by torch.distributed rank, as webdataset's split_by_node does): the
    # stages would pair one sample's inputs with another's labels, so it is refused at the first batch
    "rank_sharded_loader": dict(
        model=dict(optimizer="sgd"),
        strategy=dict(partition="uniform", rebalance="never", micro_batches=2),
        trainer=dict(max_steps=2),
        train_loader="rank_sharded",
    ),
    # the same for a validation loader: its metrics would pair inputs with other samples' targets
    "rank_sharded_val_loader": dict(
        model=dict(optimizer="sgd"),
        strategy=dict(partition="uniform", rebalance="never", micro_batches=2),
        trainer=dict(max_epochs=1, limit_train_batches=2),
        val_loader="rank_sharded",
    ),
    # the inputs differ off stage 0 (random augmentation drawn per process), the labels agree: only stage 0
    # computes on inputs, so this trains as one process on stage 0's data, and is not refused
    "inputs_differ_off_stage_0": dict(
        model=dict(optimizer="sgd"),
        strategy=dict(partition="uniform", rebalance="never", micro_batches=2),
        trainer=dict(max_epochs=2),
        train_loader="noisy_off_stage_0",
    ),
    # nanoGPT's forward (an assert, size unpacking, a mask buffer cut by a traced length), blocks migrating
    "nano_gpt_migrate": dict(
        model=dict(optimizer="adamw"),
        model_class="nano_gpt",
        strategy=dict(partition=[1, 8], rebalance=EAGER),
        # float64: the key bias gets a zero gradient up to rounding, which Adam would scale up
        trainer=dict(max_steps=6, precision="64-true"),
    ),
    # forward only hands its input to self.model, and the steps call self.model themselves: run as
    # self(...) on 2 stages from a lopsided start, migrating, validated at the epoch's end
    "delegating_wrapper": dict(
        model=dict(optimizer="adam"),
        model_class="wrapper",
        strategy=dict(partition=[1, 10], rebalance=2, micro_batches=4),
        trainer=dict(max_epochs=1, precision="64-true"),
        validate=True,
    ),
    # Lightning's README autoencoder: its steps run self.encoder (what forward returns) and then the decoder,
    # which no layer of forward uses and so lives on the last stage
    "lightning_autoencoder": dict(
        model=dict(optimizer="adam"),
        model_class="autoencoder",
        strategy=dict(partition=[1, 4], rebalance=2, micro_batches=4),
        trainer=dict(max_steps=8, precision="64-true"),
    ),
    "crash_resume": dict(
        model=dict(optimizer="adam"),
        strategy=dict(partition=[1, 19], rebalance="never", micro_batches=2),
        trainer=dict(max_steps=6, limit_train_batches=2),
        resume="last",
    ),
}
# example_input_array set, with Lightning's model summary on (it runs the example through the model)
SCENARIOS["example_input_summary"] = {
    **SCENARIOS["gpipe_sgd_clip_accumulate"],
    "model_class": "example_input",
    "model_summary": True,
}
# the same with steps that call the one layer themselves (as many of Lightning's own tests write BoringModel)
SCENARIOS["relay_stages_direct_calls"] = {**SCENARIOS["relay_stages"], "model_class": "one_direct"}
SCENARIOS["stop_in_training_step_host_flag"] = {
    **SCENARIOS["stop_in_training_step"],
    "skip_flag_on_host": True,
}
# the skipped micro-batches with the skip flag broadcast on the host apart from the loss (the GPU's way)
SCENARIOS["skipped_micro_batches_host_flag"] = {
    **SCENARIOS["skipped_micro_batches_custom_backward"],
    "skip_flag_on_host": True,
}


class BackwardHooks(pl.Callback):
    """Counts Lightning's backward and zero-grad hooks; notes whether on_after_backward saw this stage's
    gradients."""

    def __init__(self) -> None:
        self.before = self.after = self.after_with_grads = self.before_zero_grad = 0

    def on_before_zero_grad(self, trainer, pl_module, optimizer):  # noqa: ANN001
        self.before_zero_grad += 1

    def on_before_backward(self, trainer, pl_module, loss):  # noqa: ANN001
        self.before += 1

    def on_after_backward(self, trainer, pl_module):  # noqa: ANN001
        self.after += 1
        owned = [p for p in pl_module.parameters() if p.numel() > 0]
        self.after_with_grads += int(bool(owned) and all(p.grad is not None for p in owned))


class PredictionFiles(BasePredictionWriter):
    """Lightning's per-rank prediction files (what a user merges after a multi-process predict)."""

    def __init__(self, directory: Path) -> None:
        super().__init__("batch_and_epoch")
        self.directory = directory
        self.batch_writes: list[torch.Tensor] = []

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, *_):  # noqa: ANN001, ANN002, ANN201
        self.batch_writes.append(prediction)

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):  # noqa: ANN001, ANN201
        path = self.directory / f"predictions.rank{trainer.global_rank}.pt"
        state = {"predictions": predictions, "batch_indices": batch_indices}
        torch.save({**state, "batch_writes": self.batch_writes}, path)


class TorchSaveCounter(pl.Callback):
    """Counts ``torch.save`` calls from the start of training to its end, as Lightning's
    test_model_checkpoint_no_extraneous_invocations does to prove only rank 0 writes checkpoints."""

    def __init__(self) -> None:
        self.calls = 0
        self._original = torch.save

    def on_train_start(self, trainer, pl_module):  # noqa: ANN001
        def counting_save(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.calls += 1
            return self._original(*args, **kwargs)

        torch.save = counting_save

    def on_train_end(self, trainer, pl_module):  # noqa: ANN001
        torch.save = self._original


class RunProbe(pl.Callback):
    """What this rank's callbacks see during the fit: the callback list, and at its end the metric the module
    logs in its own on_train_epoch_end."""

    def __init__(self) -> None:
        self.callbacks_at_fit_start: list[str] = []
        self.train_epoch_loss: float | None = None
        self.tied_seen: list[list] = []  # each distinct [parameter, stages holding a replica] of a step
        # per step: modules that raise when called here, against those whose own state is empty here
        self.guard_mismatches: list[dict] = []
        self.guarded_counts: list[int] = []
        self.hooked_after_fit: list[str] | None = None
        # per step: how many of the step's backwards had run when the loss's receive was posted (None: not)
        self.loss_receive_posted: list[int | None] = []

    def on_train_start(self, trainer, pl_module):  # noqa: ANN001
        strategy, schedule = trainer.strategy, trainer.strategy.engine.schedule
        engine_step, backward, receive = strategy.engine.train_step, schedule._compute_backward, None
        backwards = [0]

        def counted_backward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            backwards[0] += 1
            return backward(*args, **kwargs)

        def watched_receive() -> None:
            receive()
            if strategy._loss_receive is not None:
                self.loss_receive_posted[-1] = backwards[0]

        def watched(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            nonlocal receive
            receive, backwards[0] = schedule.after_messages, 0
            schedule.after_messages = watched_receive
            self.loss_receive_posted.append(None)
            return engine_step(*args, **kwargs)

        schedule._compute_backward = counted_backward
        strategy.engine.train_step = watched

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
        for tied in trainer.strategy.engine.tied:
            if [tied.name, list(tied.stages)] not in self.tied_seen:
                self.tied_seen.append([tied.name, list(tied.stages)])
        hooked = sorted(name for name, module in pl_module.named_modules() if module._forward_pre_hooks)
        released = sorted(
            name
            for name, module in pl_module.named_modules()
            if module is not pl_module
            and (own := [*module.parameters(recurse=False), *module.buffers(recurse=False)])
            and all(tensor.numel() == 0 for tensor in own)
        )
        self.guarded_counts.append(len(hooked))
        if hooked != released:
            self.guard_mismatches.append({"step": batch_idx, "hooked": hooked, "released": released})

    def on_fit_end(self, trainer, pl_module):  # noqa: ANN001
        modules = pl_module.named_modules()
        self.hooked_after_fit = [name for name, module in modules if module._forward_pre_hooks]

    def on_fit_start(self, trainer, pl_module):  # noqa: ANN001
        self.callbacks_at_fit_start = [type(cb).__name__ for cb in trainer.callbacks]

    def on_train_end(self, trainer, pl_module):  # noqa: ANN001
        value = trainer.callback_metrics.get("train_epoch_loss")
        self.train_epoch_loss = None if value is None else float(value)


def _count_tied_all_reduces(strategy: HierPipelineStrategy) -> list[int]:
    """Count the all-reduces this rank issues where the strategy sums tied gradients (before each
    optimizer step): a stage holding no replica must issue none."""
    count = [0]
    summing = strategy.before_optimizer_step_hooks

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        count[0] += 1
        return all_reduce(*args, **kwargs)

    def before_optimizer_step_hooks() -> None:
        with mock.patch.object(dist, "all_reduce", counted):
            summing()

    all_reduce = dist.all_reduce
    strategy.before_optimizer_step_hooks = before_optimizer_step_hooks  # type: ignore[method-assign]
    return count


class LossRecorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.batches: list[list[int]] = []  # the labels of every batch this process read
        self.val_losses: list[float] = []  # after each validation (every stage sees the last stage's)
        self.extra_keys: list[list[str]] = []  # the keys besides "loss" of each step's outputs

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
        if isinstance(batch, (list, tuple)):  # not a step that pulls from dataloader_iter
            self.batches.append(batch[1].tolist())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
        if outputs:  # a skipped step (training_step returned None) has none
            self.losses.append(float(outputs["loss"]))
            self.extra_keys.append(sorted(set(outputs) - {"loss"}))

    def on_validation_end(self, trainer, pl_module):  # noqa: ANN001
        if not trainer.sanity_checking and "val_loss" in trainer.callback_metrics:
            self.val_losses.append(float(trainer.callback_metrics["val_loss"]))


def _install_crash(stage_to_kill: int, strategy: HierPipelineStrategy) -> None:
    """The source stage dies after announcing its first layer, before sending it."""
    original = dist.send_object_list
    calls = {"n": 0}

    def send_object_list(objects, dst=None, group=None, device=None, group_dst=None):  # noqa: ANN001, ANN202
        if strategy.stage == stage_to_kill:
            calls["n"] += 1
            if calls["n"] == 2:
                os._exit(17)
        return original(objects, dst=dst, group=group, device=device, group_dst=group_dst)

    dist.send_object_list = send_object_list


def _probe_memory_limit(precision: str) -> int:
    """A limit between what every stage needs at least and what keeping everything takes."""
    pl.seed_everything(0, verbose=False)
    strategy = HierPipelineStrategy(
        partition="uniform", rebalance="never", micro_batches=4, profile_steps=2, memory_limit=10**12
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=strategy,
        max_steps=3,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(SkewedNet(optimizer="adam"), loader())
    from lightning_hier.pipeline.memory_policy import estimate_peak_bytes, minimum_peak_bytes

    engine = strategy.engine
    assert engine is not None
    stats = engine.layer_memory_stats()
    in_flight = engine.schedule.in_flight_limit(4)
    base, held = engine.base_bytes(), engine.schedule.held_bytes
    mine = (
        minimum_peak_bytes(stats, in_flight, base, held),
        estimate_peak_bytes(stats, {}, in_flight, base, held),
    )
    both: list = [None] * trainer.world_size
    dist.all_gather_object(both, mine)
    lowest = max(m for m, _ in both)
    keep_all = max(k for _, k in both)
    assert keep_all > lowest, both
    return (lowest + keep_all) // 2


def _special_loader(kind: str) -> DataLoader:
    """``rank_sharded``: this process's shard of the data set (by rank); ``noisy_off_stage_0``: the data set
    with noise on the inputs of every process but stage 0's (the last rank), labels unchanged."""
    x, y = dataset().tensors
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # before fit starts the group
    if kind == "rank_sharded":
        return DataLoader(TensorDataset(x[rank::world], y[rank::world]), batch_size=32)
    if rank != world - 1:
        x = x + torch.randn(x.shape, generator=torch.Generator().manual_seed(rank))
    return DataLoader(TensorDataset(x, y), batch_size=32)


def split_backward_counts(engine) -> dict | None:  # noqa: ANN001
    """This stage's split backward (pipeline/weight_grad.py): its stage and what it did, or None."""
    split = engine.executor.weight_grads
    if split is None:
        return {"stage": engine.stage, "input": None}
    counts = split.counts
    return {
        "stage": engine.stage,
        "input": counts.input_passes,
        "weight": counts.weight_passes,
        "checked": counts.checked,
        "fell_back": counts.fell_back,
        "linear": counts.linear_calls,
    }


def main() -> None:
    name, out, workdir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    spec = SCENARIOS[name]
    if spec.get("memory_probe"):
        spec["strategy"]["memory_limit"] = _probe_memory_limit(spec["trainer"].get("precision", "32-true"))
    pl.seed_everything(0, verbose=False)
    model = MODELS[spec.get("model_class", "skewed")](**spec["model"])
    if spec.get("tied_apart_off_rank0") and int(os.environ["RANK"]) != 0:
        with torch.no_grad():  # as if built without a common seed: the replicas must start as rank 0's
            model.enc.weight.add_(1.0)
    recorder = LossRecorder()
    hooks = BackwardHooks()
    saves = TorchSaveCounter()
    probe = RunProbe()
    callbacks: list[pl.Callback] = [recorder, hooks, saves, probe]
    if spec.get("rebalancer"):
        callbacks.append(StageRebalancer(output_dir=str(workdir / "rebalancer")))
    if spec.get("monitor"):
        callbacks.append(ModelCheckpoint(dirpath=workdir / "monitor", monitor="val_loss", save_top_k=1))
        callbacks.append(PredictionFiles(workdir))
    if spec.get("top_k"):
        callbacks.append(
            ModelCheckpoint(
                dirpath=workdir / "topk", monitor="val_loss", save_top_k=spec["top_k"], filename="{epoch}"
            )
        )
    if spec.get("every_step_checkpoint"):
        callbacks.append(ModelCheckpoint(dirpath=workdir / "every", every_n_train_steps=1, save_last=True))
    strategy = HierPipelineStrategy(**spec["strategy"])
    for name, value in spec.get("tuning", {}).items():  # the strategy's tuning attributes
        setattr(strategy, name, value)
    tied_all_reduces = _count_tied_all_reduces(strategy)
    strategy.skip_flag_on_host = spec.get("skip_flag_on_host")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=strategy,
        logger=False,
        enable_checkpointing=bool(
            spec.get("monitor") or spec.get("every_step_checkpoint") or spec.get("top_k")
        ),
        enable_progress_bar=False,
        enable_model_summary=spec.get("model_summary", False),
        num_sanity_val_steps=0,
        callbacks=callbacks,
        default_root_dir=str(workdir),
        **spec["trainer"],
    )
    if "crash_stage" in spec:
        _install_crash(spec["crash_stage"], strategy)
    resume = spec.get("resume")
    ckpt_path = None
    if resume == "last":
        ckpt_path = str(workdir / "every" / "last.ckpt")
    elif resume is not None:
        ckpt_path = str(workdir / f"{resume}.ckpt")
    validate = spec.get("monitor") or spec.get("top_k") or spec.get("validate")
    val_loader = loader(batch_size=32, seed=1) if validate else None
    if spec.get("val_loader"):
        val_loader = _special_loader(spec["val_loader"])
    if spec.get("train_loader"):
        train_loader = _special_loader(spec["train_loader"])
    elif spec.get("flagged"):
        train_loader = flagged_loader()
    elif spec.get("gain"):
        train_loader = gain_loader()
    elif spec.get("model_class") in ("gpt", "nano_gpt"):
        train_loader = token_loader()
    else:
        train_loader = loader(batch_size=spec.get("batch_size", 32), shuffle=spec.get("shuffle", False))
    callbacks_before = [type(cb).__name__ for cb in trainer.callbacks]
    trainer.fit(
        torch.compile(model, backend=spec["compile_module"]) if spec.get("compile_module") else model,
        train_loader,
        val_dataloaders=val_loader,
        ckpt_path=ckpt_path,
    )
    # after fit every rank's module holds the whole trained model, as under ddp
    module_after_fit = workdir / f"{name}.module_after_fit.rank{trainer.global_rank}.pt"
    torch.save(model.state_dict(), module_after_fit)
    if trainer.optimizers:  # and its optimizer the whole state
        optimizer_after_fit = workdir / f"{name}.optimizer_after_fit.rank{trainer.global_rank}.pt"
        torch.save(trainer.optimizers[0].state_dict(), optimizer_after_fit)
    final = workdir / f"{name}.ckpt"
    trainer.save_checkpoint(final)
    result: dict = {"losses": recorder.losses, "checkpoint": str(final)}
    result["module_after_fit"] = str(workdir / f"{name}.module_after_fit.rank{{rank}}.pt")
    result["optimizer_after_fit"] = str(workdir / f"{name}.optimizer_after_fit.rank{{rank}}.pt")
    result["val_losses"] = recorder.val_losses
    result["extra_keys"] = recorder.extra_keys
    if spec.get("top_k"):
        result["top_k_files"] = sorted(p.name for p in (workdir / "topk").iterdir())
    if spec.get("monitor"):
        checkpoint_cb = next(cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint))
        result["best_score"] = float(checkpoint_cb.best_model_score)
        result["best_path"] = checkpoint_cb.best_model_path
        result["val_loss_seen_by_rank"] = float(trainer.callback_metrics["val_loss"])
        predictions = trainer.predict(model, loader(batch_size=32, seed=2))
        if trainer.is_global_zero:
            result["predictions"] = torch.cat(predictions).tolist()
        result["prediction_files"] = str(workdir / "predictions.rank{rank}.pt")
        # a fresh Trainer, strategy (another split) and module validate the best checkpoint
        fresh = pl.Trainer(
            accelerator="cpu",
            devices=int(os.environ.get("WORLD_SIZE", "1")),
            strategy=HierPipelineStrategy(partition="uniform"),
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        metrics = fresh.validate(
            SkewedNet(), loader(batch_size=32, seed=1), ckpt_path=checkpoint_cb.best_model_path
        )
        fresh_validate_val_loss = float(metrics[0]["val_loss"])  # every rank's result, as under ddp
        # predict released the other stages' layers again and gave them back at its teardown
        torch.save(model.state_dict(), workdir / f"{name}.module_after_predict.rank{trainer.global_rank}.pt")
        result["module_after_predict"] = str(workdir / f"{name}.module_after_predict.rank{{rank}}.pt")
    engine = strategy.engine
    assert engine is not None
    result["history"] = [event.to_dict() for event in engine.history]
    result["partition"] = engine.partition.to_dict()
    result["checks"] = engine.checks
    result["tied_seen"] = probe.tied_seen
    mine = {
        "val_loss": result.get("val_loss_seen_by_rank"),
        "measured_peak": engine.measured_peak_bytes(),
        "batches": recorder.batches,
        "backward_hooks": [hooks.before, hooks.after, hooks.after_with_grads, hooks.before_zero_grad],
        "memory_plan": engine.memory_plan.to_dict() if engine.memory_plan is not None else None,
        "headers_sent": engine.link.headers_sent,
        "peak_in_flight": engine.schedule.peak_in_flight,
        "torch_save_calls": saves.calls,
        "predict_returned": len(predictions) if spec.get("monitor") else None,
        "fresh_validate_val_loss": fresh_validate_val_loss if spec.get("monitor") else None,
        # what the strategy added to trainer.callbacks for the run is gone again (fit and predict)
        "callbacks_as_before": [type(cb).__name__ for cb in trainer.callbacks] == callbacks_before,
        # and during the run: the strategy adds no callback of its own
        "callbacks_during_fit_as_before": probe.callbacks_at_fit_start == callbacks_before,
        "train_epoch_loss": probe.train_epoch_loss,
        "tied_all_reduces": tied_all_reduces[0],
        "guard": [probe.guard_mismatches, probe.guarded_counts, probe.hooked_after_fit],
        "example_input_after_fit": getattr(model, "example_input_array", None) is not None,
        "loss_receive_posted": probe.loss_receive_posted,
        "split": split_backward_counts(engine),
    }
    gathered: list = [None] * trainer.world_size
    dist.all_gather_object(gathered, mine)
    result["val_loss_by_rank"] = [g["val_loss"] for g in gathered]
    result["tied_all_reduces_by_rank"] = [g["tied_all_reduces"] for g in gathered]
    result["train_epoch_loss_by_rank"] = [g["train_epoch_loss"] for g in gathered]
    result["callbacks_during_fit_as_before_by_rank"] = [g["callbacks_during_fit_as_before"] for g in gathered]
    result["measured_peak_by_rank"] = [g["measured_peak"] for g in gathered]
    result["batches_by_rank"] = [g["batches"] for g in gathered]
    result["backward_hooks_by_rank"] = [g["backward_hooks"] for g in gathered]
    result["memory_plan_by_rank"] = [g["memory_plan"] for g in gathered]
    result["headers_sent_by_rank"] = [g["headers_sent"] for g in gathered]
    result["peak_in_flight_by_rank"] = [g["peak_in_flight"] for g in gathered]
    result["torch_save_calls_by_rank"] = [g["torch_save_calls"] for g in gathered]
    result["predict_returned_by_rank"] = [g["predict_returned"] for g in gathered]
    result["fresh_validate_val_loss_by_rank"] = [g["fresh_validate_val_loss"] for g in gathered]
    result["callbacks_as_before_by_rank"] = [g["callbacks_as_before"] for g in gathered]
    result["guard_by_rank"] = [g["guard"] for g in gathered]
    result["example_input_after_fit_by_rank"] = [g["example_input_after_fit"] for g in gathered]
    result["loss_receive_posted_by_rank"] = [g["loss_receive_posted"] for g in gathered]
    result["split_by_rank"] = [g["split"] for g in gathered]
    result["memory_limit"] = spec["strategy"].get("memory_limit")
    result["gathered"] = getattr(model, "gathered", None)
    if trainer.is_global_zero:
        out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
