"""Run under torchrun (4 processes): ``hier_bsp`` through Lightning, asynchronous and resumed.

``bsp_lightning_checks.py OUT_DIR`` runs two scenarios; rank 0 writes ``OUT_DIR/results.json``:

- ``straggler``: ``superstep=1, max_staleness=1``, rank 3 sleeps after every batch (about 4x
  slower), two epochs, a CSVLogger in ``OUT_DIR/logs``. Each rank reports the optimizer steps it
  computed and the samples it trained on; the test reads the per-superstep metrics back from the CSV.
  Batches are shared (the default): the straggler should take fewer. ``fixed_shards``: the same with
  ``_share_batches=False`` (each worker its own quarter; an epoch ends for all when one runs out), and a
  validation loop with a ``sync_dist`` metric at every epoch end: a worker whose epoch ended with the
  others' must validate too, or the ranks' collectives do not pair up (the fit would hang).
- ``timed``: ``superstep="0.05s", max_staleness=0`` with the same straggler and validation: no
  gradient is ever stale, yet the fast workers fold more micro-steps per superstep than the straggler.
- ``fill``: ``superstep=1, max_staleness=0, fill_idle=1, gradient_average="nominal"``, the same
  straggler (8x slower here, so a fast step fits in its wait) and validation: never stale, fast workers
  fold up to two micro-steps per superstep.
- ``resume`` (and ``resume_time_buckets``, with ``bucketing="time"``): plain BSP (``superstep=1,
  max_staleness=0``), Adam: two epochs in one run against
  one epoch, a checkpoint, and the second epoch resumed from it; also the checkpoint loaded into
  a bare module. ``resume_replicated_server``: the same with ``devices_per_node=1`` (every rank holds the
  whole server and its optimizer state).
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from models import EquivModel, loader, tuned  # noqa: E402
from train_equivalence import ValidatedModel, max_rel_diff  # noqa: E402

from lightning_hier import HierBSPStrategy, TimeBuckets  # noqa: E402


class SlowRank(pl.Callback):
    """Rank ``rank`` sleeps ``factor`` times as long as the others after every batch; every rank notes its
    samples."""

    def __init__(self, rank: int, seconds: float, factor: int = 4) -> None:
        self.rank, self.seconds, self.factor = rank, seconds, factor
        self.seen: list[float] = []  # the first feature of every sample trained on

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.seen.extend(batch[0][:, 0].tolist())
        time.sleep(self.seconds * (self.factor if trainer.global_rank == self.rank else 1))


class StopOneRank(pl.Callback):
    """Rank ``rank`` alone sets ``trainer.should_stop`` after its batch ``batch_idx`` (as its own ``Timer``
    clock or a user's own condition would)."""

    def __init__(self, rank: int, batch_idx: int) -> None:
        self.rank, self.batch_idx = rank, batch_idx

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_rank == self.rank and batch_idx == self.batch_idx:
            trainer.should_stop = True


def trainer(strategy: HierBSPStrategy, root: Path, **kwargs) -> pl.Trainer:  # noqa: ANN003
    return pl.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, **kwargs,
    )  # fmt: skip


class Validated(ValidatedModel):
    """A validation loop whose ``sync_dist`` metric needs every rank at each epoch end; counts the runs."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        self.validations = 0

    def on_validation_epoch_end(self) -> None:
        self.validations += 0 if self.trainer.sanity_checking else 1


class OneCycle(EquivModel):
    """Sizes a OneCycleLR by ``trainer.estimated_stepping_batches`` in ``configure_optimizers``, as Lightning
    documents it (which loads the train data there, before the strategy's setup), and notes the estimate."""

    def configure_optimizers(self):  # noqa: ANN201
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        self.estimate = int(self.trainer.estimated_stepping_batches)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.2, total_steps=self.estimate)
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]


def straggler(
    out: Path,
    share_batches: bool | None = None,
    epochs: int = 2,
    validate: bool = False,
    max_steps: int = -1,
    slow_factor: int = 4,
    stop_rank_at: tuple[int, int] | None = None,
    one_cycle: bool = False,
    **settings: object,
) -> dict:
    pl.seed_everything(7, verbose=False)
    model = OneCycle() if one_cycle else Validated() if validate else EquivModel(optimizer="sgd")
    strategy = HierBSPStrategy(
        **(settings or {"superstep": 1, "max_staleness": 1}),
        devices_per_node=2,
        bucket_cap_mb=0.002,
    )
    tuned(strategy, _share_batches=share_batches)
    slow = SlowRank(3, 0.01, slow_factor)
    stop = [StopOneRank(*stop_rank_at)] if stop_rank_at else []
    run = trainer(
        strategy, out, max_epochs=epochs, logger=CSVLogger(out / "logs", name="bsp"),
        enable_checkpointing=False, callbacks=[slow, *stop], log_every_n_steps=1, max_steps=max_steps,
        reload_dataloaders_every_n_epochs=int(one_cycle),
    )  # fmt: skip
    data = loader(n=512)
    run.fit(model, train_dataloaders=data, val_dataloaders=loader(n=64) if validate else None)
    validations = [None] * dist.get_world_size()
    dist.all_gather_object(validations, getattr(model, "validations", 0))
    steps = [None] * dist.get_world_size()
    dist.all_gather_object(steps, run.global_step)
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, slow.seen)
    every = sorted(x for x in data.dataset.tensors[0][:, 0].tolist() for _ in range(epochs))
    state = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    states = [torch.empty_like(state) for _ in steps]
    dist.all_gather(states, state)
    metrics = Path(run.logger.log_dir) / "metrics.csv" if run.is_global_zero else None
    return {
        "computed": steps,
        "metrics_csv": str(metrics) if metrics else None,
        "same_model_everywhere": all(torch.equal(s, states[0]) for s in states),
        "samples": [len(s) for s in seen],
        "each_sample_once_per_epoch": sorted(x for s in seen for x in s) == every,
        "validations": validations,
        "estimate": getattr(model, "estimate", None),
    }


def rank_0_stops(out: Path, batch_idx: int, share_batches: bool | None = None) -> dict:
    """:func:`straggler` for three epochs with validation where rank 0 alone sets ``should_stop`` after its
    batch ``batch_idx``; the strategy's timeout is short, so a fit where the others train on fails here
    within a minute, not at the job's end."""
    return straggler(
        out, share_batches=share_batches, validate=True, epochs=3, stop_rank_at=(0, batch_idx),
        superstep=1, max_staleness=1, timeout=timedelta(seconds=60),
    )  # fmt: skip


def resume(
    out: Path,
    bucketing: str = "size",
    optimizer: str = "adam",
    scheduler: bool = False,
    devices_per_node: int = 2,
) -> dict:
    # time buckets: each run profiles one micro-step and rebuilds its engine (the resumed one again,
    # after the checkpoint was loaded into size buckets)
    timed = dict(bucketing=TimeBuckets(profile_steps=1, warmup_steps=0, min_bucket_mb=0.0))

    def fit(epochs: int, ckpt: str | None = None) -> tuple[EquivModel, pl.Trainer]:
        pl.seed_everything(11, verbose=False)
        model = EquivModel(optimizer=optimizer, scheduler=scheduler)
        strategy = HierBSPStrategy(
            superstep=1, max_staleness=0, devices_per_node=devices_per_node, bucket_cap_mb=0.002,
            **(timed if bucketing == "time" else {}),
        )  # fmt: skip
        run = trainer(strategy, out, max_epochs=epochs, logger=False, enable_checkpointing=False)
        run.fit(model, train_dataloaders=loader(), ckpt_path=ckpt)
        rebuilt.append(strategy.time_plan is not None)
        return model, run

    rebuilt: list[bool] = []  # per fit: whether its engine was rebuilt on a time plan

    whole, _ = fit(2)
    first, run = fit(1)
    path = str(out / "half.ckpt")
    run.save_checkpoint(path)
    resumed, _ = fit(2, ckpt=path)
    bare = EquivModel(optimizer=optimizer)
    bare.load_state_dict(torch.load(path, weights_only=False)["state_dict"])
    return {
        "max_rel_diff": max_rel_diff(whole.state_dict(), resumed.state_dict()),
        "halfway_moved": max_rel_diff(whole.state_dict(), first.state_dict()),
        "bare_equals_halfway": max_rel_diff(first.state_dict(), bare.state_dict()),
        "rebuilt": rebuilt,
    }


class SyncedInTraining(EquivModel):
    """Cross-rank values inside ``training_step``: a ``sync_dist`` sum of ``(rank + 1) x (batch_idx + 1)``,
    the same through ``strategy.reduce``, and an ``all_gather`` of the rank, every step."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        self.reduced: list[float] = []
        self.gathered: list[list[int]] = []
        self.decisions: list[list[bool]] = []

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        value = float((self.global_rank + 1) * (batch_idx + 1))
        self.log("synced", value, on_step=True, on_epoch=False, sync_dist=True, reduce_fx="sum")
        reduced = self.trainer.strategy.reduce(torch.tensor(value), reduce_op="sum")
        self.reduced.append(float(reduced))
        self.gathered.append(self.all_gather(torch.tensor(self.global_rank)).tolist())
        record_decisions(self)
        return super().training_step(batch, batch_idx)


def record_decisions(module: pl.LightningModule) -> None:
    """``reduce_boolean_decision`` as callbacks use it (``SpikeDetection``: every rank ``True`` with
    ``all=True``; only rank 3 ``True`` with ``all=False``), with the barrier before it, and a broadcast
    of the rank from rank 0."""
    strategy = module.trainer.strategy
    strategy.barrier("decisions")
    module.decisions.append(
        [
            strategy.reduce_boolean_decision(True, all=True),
            strategy.reduce_boolean_decision(module.global_rank == 3, all=False),
            strategy.broadcast(module.global_rank),  # as the learning-rate finder broadcasts should_stop
        ]
    )


class DecidingInTraining(EquivModel):
    """Boolean decisions and barriers inside ``training_step`` while workers run free."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        self.decisions: list[list[bool]] = []

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        record_decisions(self)
        return super().training_step(batch, batch_idx)


def decisions_running_free(out: Path) -> dict:
    """Non-lockstep workers with a straggler (so they take different numbers of steps): a decision stays
    the worker's own and the barrier does not wait (a regression would show as ``all=True`` reading
    ``True`` as ``False``)."""
    pl.seed_everything(7, verbose=False)
    model = DecidingInTraining()
    strategy = HierBSPStrategy(superstep=1, max_staleness=1, devices_per_node=2, bucket_cap_mb=0.002)
    run = trainer(strategy, out, max_epochs=1, callbacks=[SlowRank(3, 0.005)], logger=False)
    run.fit(model, train_dataloaders=loader(n=256))
    steps = [None] * dist.get_world_size()
    dist.all_gather_object(steps, model.decisions)
    return {"decisions": steps}


def synced_in_lockstep(out: Path) -> dict:
    """Lockstep with two micro-steps per superstep and a straggler (so workers are at different steps
    inside a superstep): per-step collectives pair by step, as under ddp (a regression would show as the
    values staying each worker's own, and all_gather raising)."""
    pl.seed_everything(7, verbose=False)
    model = SyncedInTraining()
    strategy = HierBSPStrategy(superstep=2, max_staleness=0, devices_per_node=2, bucket_cap_mb=0.002)
    run = trainer(strategy, out, max_epochs=1, callbacks=[SlowRank(3, 0.005)], logger=False)
    run.fit(model, train_dataloaders=loader(n=256))
    return {
        "reduced": model.reduced,
        "gathered": model.gathered,
        "decisions": model.decisions,
        "logged_last": float(run.callback_metrics["synced"]),
        "steps": run.global_step,
    }


def fast_dev_run(out: Path) -> dict:
    """Lightning's debugging run with the default, non-lockstep settings: 3 steps per worker."""
    model = Validated()
    strategy = HierBSPStrategy(superstep=1, max_staleness=1, devices_per_node=2, bucket_cap_mb=0.002)
    run = trainer(strategy, out, fast_dev_run=3)
    run.fit(model, train_dataloaders=loader(), val_dataloaders=loader(n=64))
    steps = [None] * dist.get_world_size()
    dist.all_gather_object(steps, run.global_step)
    state = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    states = [torch.empty_like(state) for _ in steps]
    dist.all_gather(states, state)
    return {"computed": steps, "same_model_everywhere": all(torch.equal(s, states[0]) for s in states)}


def main() -> None:
    out = Path(sys.argv[1])
    results = {
        "straggler": straggler(out / "straggler"),
        "fixed_shards": straggler(out / "fixed", share_batches=False, validate=True),
        "timed": straggler(
            out / "timed", validate=True, superstep="0.05s", max_staleness=0
        ),
        "fill": straggler(
            out / "fill",
            validate=True,
            superstep=1,
            max_staleness=0,
            fill_idle=1,
            gradient_average="nominal",
            # a fast worker fills only where a whole step fits before the straggler folds; with 4
            # processes on 2 loaded cores a 4x sleep left no such room and the straggler kept up
            slow_factor=8,
        ),  # fmt: skip
        "fast_dev_run": fast_dev_run(out / "fast_dev_run"),
        # a OneCycleLR sized by estimated_stepping_batches in configure_optimizers, the loader reloaded every
        # epoch: the workers keep fixed shares, so no worker steps the schedule past its end
        "one_cycle": straggler(out / "one_cycle", one_cycle=True),
        "synced_in_lockstep": synced_in_lockstep(out / "synced"),
        "decisions_running_free": decisions_running_free(out / "decisions"),
        # max_steps mid-epoch with free-running workers: the fastest worker's 11th step ends the fit
        "max_steps": straggler(out / "max_steps", validate=True, epochs=3, max_steps=11),
        # rank 0 alone sets should_stop after its 6th batch of the first epoch
        "stop_one_rank": rank_0_stops(out / "stop_one", batch_idx=5),
        # rank 0 alone sets it at its epoch's last batch (fixed shares: batch 15 of 16), after every worker
        # drained for the epoch's end
        "stop_one_rank_at_epoch_end": rank_0_stops(out / "stop_one_last", batch_idx=15, share_batches=False),
        "resume": resume(out / "resume"),
        "resume_time_buckets": resume(out / "resume_time", bucketing="time"),
        # an LR scheduler stepping every step: the checkpoint must hold the decayed rates
        "resume_scheduler": resume(out / "resume_scheduler", optimizer="adamw_groups", scheduler=True),
        # one device per node: every rank holds the whole server (its optimizer state for the whole model)
        "resume_replicated_server": resume(out / "resume_replicated", devices_per_node=1),
    }
    if dist.get_rank() == 0:
        (out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
