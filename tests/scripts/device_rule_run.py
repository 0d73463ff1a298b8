"""Run under torchrun (4 processes) with the groups built as on CUDA and every collective recorded.

``device_rule_run.py CASE OUT`` trains one strategy for a few steps through fit, validation,
checkpointing and test, with ``LIGHTNING_HIER_DEVICE_BACKEND=emulated_nccl`` and
``LIGHTNING_HIER_AUDIT_DIR`` set by the test (tests/test_device_rule.py), which then checks the
records of all ranks with ``lightning_hier.audit.analyze``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
from hybrid_checks import Click  # noqa: E402
from hybrid_checks import loader as hybrid_loader  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from models import EquivModel, loader  # noqa: E402
from pipeline_models import SkewedNet, TinyGPT, token_loader  # noqa: E402
from pipeline_models import loader as pipeline_loader  # noqa: E402
from torch import nn  # noqa: E402

from lightning_hier import (  # noqa: E402
    HierBSPStrategy,
    HierPipelineStrategy,
    HierSlicedStrategy,
    Rebalance,
    StageRebalancer,
    TimeBuckets,
)


class LoggedModel(EquivModel):
    """Logs with ``sync_dist`` (Lightning's own collectives) and validates.

    ``reduce_fx="max"``: Lightning averages with ``ReduceOp.AVG`` unless the group's backend is
    plain ``"gloo"``; on a GPU that reaches NCCL, here the emulation hands CPU tensors to gloo,
    which refuses AVG on integer tensors. A limit of the emulation, not of the strategies.
    """

    def validation_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True, reduce_fx="max")

    def test_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        self.log("test_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True, reduce_fx="max")


def trainer(strategy, out: Path, **kwargs) -> pl.Trainer:  # noqa: ANN001, ANN003
    return pl.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
        **kwargs,
    )


def sliced(out: Path, bucketing: str, checkpoint_format: str, slice_weights: str = "memory") -> None:
    timed = TimeBuckets(profile_steps=2, warmup_steps=1, reprofile_check_every=2, min_bucket_mb=0.0)
    strategy = HierSlicedStrategy(
        devices_per_node=2,
        bucketing=timed if bucketing == "time" else bucketing,
        bucket_cap_mb=0.002,
        checkpoint_format=checkpoint_format,
        slice_weights=slice_weights,
    )
    model = LoggedModel(optimizer="adam", batch_norm=True, quirks=True)
    checkpoint = ModelCheckpoint(dirpath=str(out / "ckpt"), monitor="val_loss", save_top_k=1)
    run = trainer(
        strategy,
        out,
        max_steps=8,
        limit_val_batches=2,
        val_check_interval=4,
        gradient_clip_val=0.5,
        callbacks=[checkpoint],
    )
    run.fit(model, loader(), loader())
    run.test(model, loader(), ckpt_path="best")


def sliced_gan(out: Path) -> None:
    """Two optimizers: toggled backwards (one engine, overlapping), then untoggled ones (both engines,
    after backward), across a checkpoint resume."""
    from strategy_checks import GanModel

    run = trainer(HierSlicedStrategy(devices_per_node=2, bucket_cap_mb=0.002), out, max_epochs=1,
                  limit_train_batches=3, enable_checkpointing=False)  # fmt: skip
    run.fit(GanModel(toggle=True), loader())
    run.save_checkpoint(str(out / "gan.ckpt"))
    run = trainer(HierSlicedStrategy(devices_per_node=2, bucket_cap_mb=0.002), out, max_epochs=2,
                  limit_train_batches=3, enable_checkpointing=False)  # fmt: skip
    run.fit(GanModel(toggle=False), loader(), ckpt_path=str(out / "gan.ckpt"))


def hybrid(out: Path) -> None:
    model = Click(hybrid=True, optimizer="adagrad")
    strategy = HierSlicedStrategy(devices_per_node=2)
    run = trainer(strategy, out, max_steps=2, enable_checkpointing=False, use_distributed_sampler=False)
    run.fit(model, hybrid_loader())
    run.save_checkpoint(str(out / "hybrid.ckpt"))
    resumed = Click(hybrid=True, optimizer="adagrad")
    run = trainer(
        HierSlicedStrategy(devices_per_node=2), out, max_steps=4, enable_checkpointing=False,
        use_distributed_sampler=False,
    )  # fmt: skip
    run.fit(resumed, hybrid_loader(), ckpt_path=str(out / "hybrid.ckpt"))


def bsp(
    out: Path,
    max_staleness: int = 1,
    fill_idle: int = 0,
    bucketing: str = "size",
    inter_node_dtype: str | None = None,
) -> None:
    # max_staleness=0 is plain BSP: there (on CUDA, as emulated here) buckets are pushed during backward;
    # with fill_idle workers take different step counts (shared batches, no early push); time buckets
    # rebuild the engine after one profiled micro-step
    timed = dict(bucketing=TimeBuckets(profile_steps=1, warmup_steps=0, min_bucket_mb=0.0))
    strategy = HierBSPStrategy(
        superstep=1, max_staleness=max_staleness, devices_per_node=2, bucket_cap_mb=0.002,
        fill_idle=fill_idle, gradient_average="nominal" if fill_idle else "folded",
        inter_node_dtype=inter_node_dtype,
        **(timed if bucketing == "time" else {}),
    )  # fmt: skip
    model = LoggedModel(optimizer="adam")
    checkpoint = ModelCheckpoint(dirpath=str(out / "ckpt"), monitor="val_loss", save_top_k=1)
    run = trainer(
        strategy, out, max_epochs=2, limit_train_batches=4, limit_val_batches=2, gradient_clip_val=0.5,
        callbacks=[checkpoint],
    )  # fmt: skip
    run.fit(model, loader(), loader())
    if max_staleness == 0 and not fill_idle:  # the audit must have seen pushes during backward (early_push)
        ready = [r.ready_buckets for r in strategy.superstep_records]
        assert ready and all(r > 0 for r in ready), ready
    if bucketing == "time":
        assert strategy.time_plan is not None and strategy._earlier_records
    run.test(model, loader(), ckpt_path="best")


def pipeline(out: Path, schedule: str) -> None:
    strategy = HierPipelineStrategy(partition=[1, 1, 1, 17], rebalance=2, micro_batches=4, schedule=schedule)
    run = trainer(
        strategy,
        out,
        max_steps=6,
        limit_val_batches=2,
        val_check_interval=3,
        callbacks=[StageRebalancer(save_figure=False, output_dir=str(out))],
        enable_checkpointing=True,
    )
    model = SkewedNet(optimizer="adam")
    run.fit(model, pipeline_loader(), pipeline_loader())


def pipeline_tied(out: Path) -> None:
    """A GPT-2-style model over 4 stages: the embedding's replicas on the first and the last stage sum
    their gradients over a group of their own (with clipping, rebalance checks every 2 steps)."""
    strategy = HierPipelineStrategy(
        partition="uniform", rebalance=Rebalance(every=2, imbalance_threshold=0.01, min_gain=0.0)
    )
    run = trainer(strategy, out, max_steps=6, gradient_clip_val=1.0)
    run.fit(TinyGPT(), token_loader())


def main() -> None:
    case, out = sys.argv[1], Path(sys.argv[2])
    pl.seed_everything(0, verbose=False)
    if case == "sliced_size":
        sliced(out, "size", "sharded")
    elif case == "sliced_time":
        sliced(out, "time", "consolidated")
    elif case == "sliced_none":
        sliced(out, "none", "consolidated", slice_weights="equal")
    elif case == "sliced_gan":
        sliced_gan(out)
    elif case == "hybrid":
        hybrid(out)
    elif case == "bsp":
        bsp(out, inter_node_dtype="int8")
    elif case == "bsp_plain":
        bsp(out, max_staleness=0)
    elif case == "bsp_fill":
        bsp(out, max_staleness=0, fill_idle=1)
    elif case == "bsp_time":
        bsp(out, max_staleness=0, bucketing="time")
    elif case == "pipeline_tied":
        pipeline_tied(out)
    elif case in ("pipeline_1f1b", "pipeline_gpipe"):
        pipeline(out, case.split("_")[1])
    else:
        raise SystemExit(f"unknown case {case}")


if __name__ == "__main__":
    main()
