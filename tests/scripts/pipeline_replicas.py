"""Run under torchrun: hier_pipeline as pipeline x data parallel, and Lightning's ``ddp`` to compare with.

    pipeline_replicas.py KIND OUT_JSON WORKDIR SCENARIO[,SCENARIO...]

``KIND`` is ``pipeline`` (``HierPipelineStrategy(stages=2)``: on 4 processes, 2 replicas of 2 stages) or
``ddp`` (Lightning's ``ddp`` on as many processes as the pipeline has replicas). Each scenario trains the same
model on the same shuffled data, in float64; rank 0 writes JSON with, per scenario, its step losses, the
values its logger received (``sync_dist`` means), what ``self.all_gather`` returned in the validation steps,
the final parameters' file and, under the pipeline, what every rank's engine did (its partition, its
rebalance history, how often it averaged gradients over the replicas) and every rank's module after fit.
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


MODELS = {"skewed": ReplicaNet, "twice": ReplicaTwiceNet}


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


def run(kind: str, name: str, workdir: Path) -> dict[str, Any]:
    spec = SCENARIOS[name]
    pl.seed_everything(0, verbose=False)
    model = MODELS[spec["model"]](optimizer="adam")
    per_replica = STAGES if kind == "pipeline" else 1  # processes per replica (ddp: one)
    assert int(os.environ["WORLD_SIZE"]) == 2 * per_replica, "two replicas"
    if spec.get("perturb_second_replica") and int(os.environ["RANK"]) // per_replica == 1:
        with torch.no_grad():
            for tensor in model.state_dict().values():
                tensor.add_(0.01)
    if kind == "pipeline":
        strategy: Any = HierPipelineStrategy(stages=STAGES, **spec["pipeline"])
        if spec.get("slow_second_replica") and int(os.environ["RANK"]) == 3:  # replica 1's stage 0
            _measure_slower(spec["slow_second_replica"])
    else:
        strategy = "ddp"
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
        callbacks=[losses],
        default_root_dir=str(workdir),
        **spec["trainer"],
    )
    validates = "limit_val_batches" in spec["trainer"]
    trainer.fit(
        model,
        loader(batch_size=BATCH_SIZE, shuffle=True),
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
        }
        engines: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(engines, mine)
        result["engines"] = engines
        result["history"] = [event.to_dict() for event in engine.history]
    if validates:  # each replica predicts its shard: its last stage returns it, as a ddp rank its own
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
