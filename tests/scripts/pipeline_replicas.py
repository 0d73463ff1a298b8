"""Run under torchrun: hier_pipeline as pipeline x data parallel, and Lightning's ``ddp`` to compare with.

    pipeline_replicas.py KIND OUT_JSON WORKDIR SCENARIO[,SCENARIO...]

``KIND`` is ``pipeline`` (``HierPipelineStrategy(stages=2)``: on 4 processes, 2 replicas of 2 stages) or
``ddp`` (Lightning's ``ddp`` on as many processes as the pipeline has replicas). Each scenario trains the same
model on the same shuffled data, in float64; rank 0 writes JSON with, per scenario, its step losses, the
values its logger received (``sync_dist`` means), what ``self.all_gather`` returned in the validation steps,
the final parameters' file and, under the pipeline, what every rank's engine did (its partition, its
rebalance history, how often it averaged gradients over the replicas, its memory plan) and every rank's
module after fit. A scenario with ``micro_as_batches`` runs ddp on batches the size of the pipeline's
micro-batches, accumulating as many more, so that BatchNorm normalises the same rows in both; its trace holds
every rank's parameters and buffers after each of the pipeline's batches (every second batch of ddp's).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.loggers import Logger  # noqa: E402
from pipeline_models import SkewedNet, TwiceNet, loader  # noqa: E402
from torch import nn  # noqa: E402

from lightning_hier import HierPipelineStrategy, Rebalance  # noqa: E402
from lightning_hier.pipeline.engine import PipelineEngine  # noqa: E402

STAGES = 2
BATCH_SIZE = 16

SCENARIOS: dict[str, dict[str, Any]] = {
    # Adam, gradient accumulation, clipping by the global norm, two epochs with validation
    "adam_clip_accumulate": dict(
        model="skewed",
        pipeline=dict(partition="uniform", rebalance="never", micro_batches=4),
        trainer=dict(
            max_epochs=2,
            limit_train_batches=4,
            limit_val_batches=2,
            accumulate_grad_batches=2,
            gradient_clip_val=0.5,
        ),
    ),
    # a lopsided start (stage 1 holds the tied `dec` and what follows it) checked every 2 steps: layers
    # migrate in both replicas alike; TwiceNet's weight tied between `enc` and `dec` starts on both stages
    # (its copies' gradients summed in each pipeline). The second replica's processes built other values:
    # every replica starts from replica 0's, as every ddp rank from rank 0's. Its first stage also measures
    # its layers 20 times slower: alone, each replica would choose its own split
    "rebalance_tied": dict(
        model="twice",
        perturb_second_replica=True,
        slow_second_replica=20.0,
        pipeline=dict(
            partition=["dec"],
            rebalance=Rebalance(every=2, imbalance_threshold=0.01, min_gain=0.0),
            micro_batches=4,
        ),
        trainer=dict(max_steps=6, gradient_clip_val=0.5),
    ),
    # BatchNorm on both stages, accumulation over 2 batches of 2 micro-batches, validation after each epoch:
    # every replica gets replica 0's running statistics where ddp gives every rank rank 0's
    "batchnorm": dict(
        model="batchnorm",
        micro_as_batches=True,
        trace=True,
        bucket_bytes=2048,
        pipeline=dict(partition="uniform", rebalance="never", micro_batches=2),
        trainer=dict(max_epochs=2, limit_train_batches=4, limit_val_batches=2, accumulate_grad_batches=2),
    ),
    # the same with the replica average run after the backward instead of in it (pipeline only)
    "batchnorm_after_backward": dict(
        model="batchnorm",
        pipeline_only=True,
        replica_overlap=False,
        trace=True,
        bucket_bytes=2048,
        pipeline=dict(partition="uniform", rebalance="never", micro_batches=2),
        trainer=dict(max_epochs=2, limit_train_batches=4, limit_val_batches=2, accumulate_grad_batches=2),
    ),
    # the collectives of the BatchNorm scenario's buffers and overlapped average, and a memory plan's
    # agreement (a limit everything fits under), recorded under the emulated NCCL (pipeline only)
    "batchnorm_audit": dict(
        model="batchnorm",
        pipeline_only=True,
        bucket_bytes=2048,
        pipeline=dict(
            partition="uniform", rebalance="never", micro_batches=2, memory_limit=10**12, profile_steps=1
        ),
        trainer=dict(max_steps=3, accumulate_grad_batches=2),
    ),
    # a memory_limit between what every stage needs at least and what keeping everything takes (probed by
    # a first fit); the second replica's host link measured far slower: alone, it would choose other policies
    "memory_limit": dict(
        model="skewed",
        memory_probe=True,
        swap_bandwidth=(1e12, 1e3),
        pipeline=dict(partition="uniform", rebalance="never", micro_batches=4, profile_steps=2),
        trainer=dict(max_steps=5),
    ),
}


class ReplicaNet(SkewedNet):
    """SkewedNet logging its loss with ``sync_dist=True`` and gathering its validation predictions."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gathered: list[list] = []

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):  # noqa: ANN001
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.gathered.append(self.all_gather(logits.argmax(-1)).tolist())


class ReplicaTwiceNet(TwiceNet):
    """TwiceNet (a weight tied across two layers) logging its loss with ``sync_dist=True``."""

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss


class BatchNormNet(pl.LightningModule):
    """Four blocks of Linear, BatchNorm1d and Tanh between a stem and a head (two blocks per stage under
    ``partition="uniform"``), logging its losses with ``sync_dist=True``."""

    def __init__(self, optimizer: str = "adam", lr: float = 0.01) -> None:
        super().__init__()
        self.lr = lr
        self.stem = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Tanh()) for _ in range(4)
        )
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):  # noqa: ANN001
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.Adam(self.parameters(), lr=self.lr)


MODELS = {"skewed": ReplicaNet, "twice": ReplicaTwiceNet, "batchnorm": BatchNormNet}


class StateTrace(pl.Callback):
    """This rank's parameters and buffers after every ``every``-th batch (the ones it holds: a pipeline
    stage's own)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.states: list[dict[str, list]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
        if (batch_idx + 1) % self.every == 0:
            state = pl_module.state_dict()
            held = {k: v.tolist() for k, v in state.items() if v.numel() and v.is_floating_point()}
            self.states.append(held)


class TuneAverage(pl.Callback):
    """The replica gradient average after the backward (``overlap=False``, as where it cannot start inside
    it) and its buckets' size in bytes (small: several buckets, most started from the hooks)."""

    def __init__(self, overlap: bool, bucket_bytes: int | None) -> None:
        self.overlap = overlap
        self.bucket_bytes = bucket_bytes

    def on_fit_start(self, trainer, pl_module):  # noqa: ANN001
        engine = trainer.strategy.engine
        engine.replica_overlap = self.overlap
        if self.bucket_bytes is not None:
            engine.replica_gradients.bucket_bytes = self.bucket_bytes


class ListLogger(Logger):
    """Keeps every logged metric (only rank 0 logs, as Lightning does)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "list"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append({key: float(value) for key, value in metrics.items()})


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
        self.values.append(float(outputs["loss"]))


def _measure_slower(factor: float) -> None:
    """This process reports every layer time it measures ``factor`` times longer (for the rest of the run)."""
    measured = PipelineEngine.local_times

    def slower(self: PipelineEngine) -> dict[str, Any]:
        times = measured(self)
        times["layers"] = {i: (f * factor, b * factor) for i, (f, b) in times["layers"].items()}
        return times

    PipelineEngine.local_times = slower  # type: ignore[method-assign]


def _probe_memory_limit(spec: dict[str, Any]) -> int:
    """A limit between what every stage needs at least and what keeping everything takes (the largest of
    each over the ranks), from a first fit with a limit everything fits under."""
    from lightning_hier.pipeline.memory_policy import estimate_peak_bytes, minimum_peak_bytes

    pl.seed_everything(0, verbose=False)
    settings = {**spec["pipeline"], "memory_limit": 10**12}
    strategy = HierPipelineStrategy(stages=STAGES, **settings)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=strategy,
        precision="64-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **spec["trainer"],
    )
    trainer.fit(MODELS[spec["model"]](optimizer="adam"), loader(batch_size=BATCH_SIZE, shuffle=True))
    engine = strategy.engine
    assert engine is not None
    stats = engine.layer_memory_stats()
    in_flight = engine.schedule.in_flight_limit(settings["micro_batches"])
    base, held = engine.base_bytes(), engine.schedule.held_bytes
    mine = (
        minimum_peak_bytes(stats, in_flight, base, held),
        estimate_peak_bytes(stats, {}, in_flight, base, held),
    )
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    lowest, keep_all = max(m for m, _ in every), max(k for _, k in every)
    assert keep_all > lowest, every
    return (lowest + keep_all) // 2


def run(kind: str, name: str, workdir: Path) -> dict[str, Any]:
    spec = SCENARIOS[name]
    if kind == "ddp" and spec.get("pipeline_only"):
        return {}
    memory_limit = _probe_memory_limit(spec) if kind == "pipeline" and spec.get("memory_probe") else None
    pl.seed_everything(0, verbose=False)
    model = MODELS[spec["model"]](optimizer="adam")
    per_replica = STAGES if kind == "pipeline" else 1  # processes per replica (ddp: one)
    assert int(os.environ["WORLD_SIZE"]) == 2 * per_replica, "two replicas"
    replica = int(os.environ["RANK"]) // per_replica
    if spec.get("perturb_second_replica") and replica == 1:
        with torch.no_grad():
            for tensor in model.state_dict().values():
                tensor.add_(0.01)
    trainer_args = dict(spec["trainer"])
    batch_size = BATCH_SIZE
    # ddp on batches of the pipeline's micro-batches, accumulating as many more: the same rows per forward
    micro = spec["pipeline"]["micro_batches"] if spec.get("micro_as_batches") else 1
    callbacks: list[pl.Callback] = []
    if kind == "pipeline":
        settings = dict(spec["pipeline"])
        if memory_limit is not None:
            settings["memory_limit"] = memory_limit
        strategy: Any = HierPipelineStrategy(stages=STAGES, **settings)
        if spec.get("slow_second_replica") and int(os.environ["RANK"]) == 3:  # replica 1's stage 0
            _measure_slower(spec["slow_second_replica"])
        if spec.get("swap_bandwidth"):
            strategy._swap_bandwidth = spec["swap_bandwidth"][replica]
        callbacks.append(TuneAverage(spec.get("replica_overlap", True), spec.get("bucket_bytes")))
    else:
        strategy = "ddp"
        batch_size //= micro
        for key in ("limit_train_batches", "accumulate_grad_batches"):
            if key in trainer_args:
                trainer_args[key] *= micro
    trace = StateTrace(every=micro if kind == "ddp" else 1) if spec.get("trace") else None
    if trace is not None:
        callbacks.append(trace)
    losses, logger = Losses(), ListLogger()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=strategy,
        precision="64-true",
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[losses, *callbacks],
        default_root_dir=str(workdir),
        **trainer_args,
    )
    validates = "limit_val_batches" in spec["trainer"]
    trainer.fit(
        model,
        loader(batch_size=batch_size, shuffle=True),
        val_dataloaders=loader(batch_size=BATCH_SIZE, seed=1) if validates else None,
    )
    rank = trainer.global_rank
    # after fit every rank's module holds the whole trained model (under the pipeline: its replica's)
    module_file = workdir / f"{kind}.{name}.module.rank{rank}.pt"
    torch.save(model.state_dict(), module_file)
    result: dict[str, Any] = {
        "losses": losses.values,
        "logged": logger.rows,
        "gathered": getattr(model, "gathered", None),
        "module": str(workdir / f"{kind}.{name}.module.rank{{rank}}.pt"),
        "steps": trainer.global_step,
    }
    if trace is not None:
        traces: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(traces, trace.states)
        result["trace_by_rank"] = traces
    if kind == "ddp" and spec.get("micro_as_batches"):
        checkpoint = workdir / f"ddp.{name}.ckpt"
        trainer.save_checkpoint(checkpoint)
        result["checkpoint"] = str(checkpoint)
    if kind == "pipeline":
        checkpoint = workdir / f"{name}.ckpt"
        trainer.save_checkpoint(checkpoint)
        result["checkpoint"] = str(checkpoint)
        engine = strategy.engine
        averages = engine.replica_gradients.averaged_steps if engine.replica_gradients is not None else None
        mine = {
            "rank": rank,
            "stage": strategy.stage,
            "replica": strategy.replica,
            "sampler": strategy.distributed_sampler_kwargs,
            "partition": engine.partition.to_dict(),
            "moves": [
                [event.step, event.decision.new.to_dict()] for event in engine.history if event.decision.new
            ],
            "checks": len(engine.checks),
            "averaged_steps": averages,
            "overlapped_steps": engine.replica_gradients.overlapped_steps,
            "buckets_from_hooks": engine.replica_gradients.buckets_from_hooks,
            "buffer_broadcasts": engine.replica_buffers.broadcasts,
            "memory_plan": engine.memory_plan.as_mapping() if engine.memory_plan is not None else None,
            "memory_limit": memory_limit,
        }
        engines: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(engines, mine)
        result["engines"] = engines
        result["history"] = [event.to_dict() for event in engine.history]
    # each replica predicts its shard: its last stage returns it, as a ddp rank its own
    if validates and spec["model"] == "skewed":
        predictions = trainer.predict(model, loader(batch_size=BATCH_SIZE, seed=2))
        predicted = [batch.tolist() for batch in predictions if batch is not None]
        by_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(by_rank, predicted)
        result["predictions_by_rank"] = by_rank
    return result


def main() -> None:
    kind, out, workdir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    results = {name: run(kind, name, workdir) for name in sys.argv[4].split(",")}
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
