"""One training process of ``bench_time_buckets.py`` (launched once per node, torchrun-style env vars).

Trains an MLP whose backward takes about as long as its gradient communication, with ``hier_sliced``
(``bucketing="time"|"size"|"none"``) or Lightning's ``ddp``, and records per measured step (rank 0):
the step time (start to start); the backward time, from its start to the end of the autograd graph
(for ``ddp`` an autograd callback queued by the first gradient hook, which runs before DDP waits for
its all-reduces); every bucket's communication span (from ``engine.last_timeline``, or for ``ddp``
from a timing communication hook around the default all-reduce); and the hidden fraction, the part of
the spans' union before the end of backward. Rank 0 writes everything as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from harness import cli
from harness.jobs import host_busy_seconds, process_cpu_seconds
from harness.worker import MLP, quiet_trainer, setup
from lightning import Callback, LightningModule, Trainer
from torch.autograd import Variable

OPTIONS = """
--strategy             {time,size,none,ddp}  required
--hidden               int    1024
--layers               int    12
--batch-size           int    512
--warmup               int    3         warm-up steps (after profiling, for time)
--steps                int    8
--profile-steps        int    3
--profile-warmup-steps int    1
--min-bucket-mb        float  1.0
--bucket-cap-mb        float  None      hier_sliced cap (default: its own)
--out                  path   required  JSON timings (written by rank 0)
--pid-dir              path   None      each worker writes rank<r>.pid here
"""


def union_and_hidden(spans: list[tuple[float, float]], backward_s: float) -> tuple[float, float]:
    """Length of the union of ``spans`` and the part of it before ``backward_s`` (same as
    ``StepTimeline.hidden_fraction``, which returns the ratio of the two)."""
    total, hidden, cursor = 0.0, 0.0, float("-inf")
    for start, done in sorted(spans):
        start = max(start, cursor)
        if done <= start:
            continue
        total += done - start
        hidden += max(0.0, min(done, backward_s) - start)
        cursor = done
    return total, hidden


class StepRecorder(Callback):
    """Step times of batches ``[warmup, warmup + steps)`` and, per measured step, the comm timeline.

    For ``ddp`` it also installs the timing communication hook and the backward markers.
    """

    def __init__(self, strategy: str, warmup: int, steps: int, pid_dir: Path | None = None) -> None:
        self.strategy = strategy
        self.warmup = warmup
        self.steps = steps
        self.pid_dir = pid_dir
        self._pids: list[int] = [os.getpid()]
        self.step_starts: list[float] = []
        self._cpu_marks: list[tuple[float, float]] = []  # (host busy s, our workers' CPU s) per step start
        self.records: list[dict[str, Any]] = []
        self.plan_info: dict[str, Any] | None = None
        self.plans_at_start: int | None = None
        # ddp timeline of the current backward
        self._bwd_start: float | None = None
        self._bwd_end: float | None = None
        self._after_backward: float | None = None
        self._end_queued = False
        self._spans: list[list[float]] = []

    # ------------------------------------------------------------------ ddp instrumentation
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Install the DDP comm hook and the gradient hooks that mark the end of backward."""
        if self.strategy != "ddp":
            return
        from torch.nn.parallel import DistributedDataParallel

        ddp_model = trainer.strategy.model
        if not isinstance(ddp_model, DistributedDataParallel):
            raise TypeError(f"expected a DistributedDataParallel wrapper, got {type(ddp_model).__name__}")
        ddp_model.register_comm_hook(state=self, hook=_timed_allreduce_hook)
        for param in pl_module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._end_queued:
            self._end_queued = True
            Variable._execution_engine.queue_callback(self._on_graph_done)

    def _on_graph_done(self) -> None:
        self._bwd_end = time.perf_counter()

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        """Start of backward (ddp): reset this step's timeline."""
        self._bwd_start = time.perf_counter()
        self._bwd_end = None
        self._end_queued = False
        self._spans = []

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """After ``loss.backward()`` returned (for ddp: after DDP waited for its all-reduces)."""
        self._after_backward = time.perf_counter()

    def record_launch(self, nbytes: int) -> list[float]:
        """Called by the comm hook when DDP hands it a bucket; returns ``[launch, done, bytes]``,
        whose ``done`` the hook fills in when the all-reduce completes."""
        span = [time.perf_counter(), float("nan"), float(nbytes)]
        self._spans.append(span)
        return span

    # ------------------------------------------------------------------ step timing
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Record the start of measured steps (and of the step after the last one)."""
        if batch_idx == self.warmup:
            if dist.is_available() and dist.is_initialized():
                dist.barrier()  # start the window with both ranks aligned and nothing in flight
            self._check_ready_to_measure(trainer)
            if self.pid_dir is not None:  # every worker wrote its pid at start
                self._pids = [int(f.read_text()) for f in sorted(self.pid_dir.glob("rank*.pid"))]
        if self.warmup <= batch_idx <= self.warmup + self.steps:
            self._cpu_marks.append((host_busy_seconds(), process_cpu_seconds(self._pids)))
            self.step_starts.append(time.perf_counter())

    def _check_ready_to_measure(self, trainer: Trainer) -> None:
        engine = getattr(trainer.strategy, "engine", None)
        if self.strategy != "time":
            return
        timing = engine.time_bucketing
        if timing is None or timing.plan is None:
            raise RuntimeError(
                f"bucketing='time' has no plan at batch {self.warmup}: the measured window would "
                "include profiling; raise --warmup"
            )
        plan = timing.plan
        self.plans_at_start = timing.plans_made
        self.plan_info = {
            "describe": plan.describe(),
            "time_points_s": list(plan.time_points),
            "bucket_bytes": list(plan.bucket_bytes),
            "buckets": [list(b) for b in plan.plan.buckets],
            "backward_seconds": plan.backward_seconds,
            "engine_buckets": len(engine.buckets),
        }

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Collect the communication timeline of a measured step."""
        if not self.warmup <= batch_idx < self.warmup + self.steps:
            return
        record = self._ddp_record() if self.strategy == "ddp" else self._hier_record(trainer)
        record["batch_idx"] = batch_idx
        self.records.append(record)

    def _ddp_record(self) -> dict[str, Any]:
        assert self._bwd_start is not None and self._bwd_end is not None
        start = self._bwd_start
        backward = self._bwd_end - start
        launch = [s - start for s, _, _ in self._spans]
        done = [d - start for _, d, _ in self._spans]
        total, hidden = union_and_hidden(list(zip(launch, done)), backward)
        return {
            "backward_s": backward,
            "after_backward_s": (self._after_backward or self._bwd_end) - start,
            "bucket_launch_s": launch,
            "bucket_done_s": done,
            "bucket_bytes": [int(b) for _, _, b in self._spans],
            "comm_union_s": total,
            "hidden_s": hidden,
            "hidden_fraction": hidden / total if total > 0 else 0.0,
            "exposed_s": max(0.0, max(done, default=0.0) - backward),
        }

    def _hier_record(self, trainer: Trainer) -> dict[str, Any]:
        engine = trainer.strategy.engine
        tl = engine.last_timeline
        total, hidden = union_and_hidden(list(zip(tl.bucket_launch, tl.bucket_done)), tl.backward_seconds)
        record = {
            "backward_s": tl.backward_seconds,
            "bucket_launch_s": list(tl.bucket_launch),
            "bucket_done_s": list(tl.bucket_done),
            "bucket_bytes": list(tl.bucket_bytes),
            "comm_union_s": total,
            "hidden_s": hidden,
            "hidden_fraction": tl.hidden_fraction(),
            "hidden_fraction_recomputed": hidden / total if total > 0 else 0.0,
            "exposed_s": max(0.0, max(tl.bucket_done, default=0.0) - tl.backward_seconds),
        }
        if engine.time_bucketing is not None:
            record["plans_made"] = engine.time_bucketing.plans_made
            record["drift"] = engine.time_bucketing.drift
        return record

    def summary(self) -> dict[str, Any]:
        """Timings of the measured window."""
        intervals = [b - a for a, b in zip(self.step_starts, self.step_starts[1:])]
        if len(intervals) != self.steps or len(self.records) != self.steps:
            raise RuntimeError(
                f"expected {self.steps} measured steps, timed {len(intervals)}, recorded {len(self.records)}"
            )

        def mean(key: str) -> float:
            return statistics.fmean(r[key] for r in self.records)

        # cores used by other processes during each step (host busy minus both workers)
        other = [
            max(0.0, (b[0] - a[0]) - (b[1] - a[1])) / dt
            for a, b, dt in zip(self._cpu_marks, self._cpu_marks[1:], intervals)
        ]
        return {
            "step_times_s": intervals,
            "other_cpu_cores_per_step": other,
            "workers_cpu_s_per_step": [b[1] - a[1] for a, b in zip(self._cpu_marks, self._cpu_marks[1:])],
            "mean_step_s": statistics.fmean(intervals),
            "median_step_s": statistics.median(intervals),
            "mean_backward_s": mean("backward_s"),
            "mean_comm_union_s": mean("comm_union_s"),
            "mean_hidden_fraction": mean("hidden_fraction"),
            "mean_exposed_s": mean("exposed_s"),
            "num_buckets": len(self.records[-1]["bucket_launch_s"]),
            "plan": self.plan_info,
            "plans_made_at_start": self.plans_at_start,
            "steps": self.records,
        }


def _timed_allreduce_hook(state, bucket):  # unannotated on purpose, see the docstring
    """DDP's default all-reduce (``allreduce_hook``), with launch and completion timestamps.

    ``state`` is the :class:`StepRecorder`, ``bucket`` a ``dist.GradBucket``; returns the
    ``Future[Tensor]`` DDP waits for. (Unannotated: with ``from __future__ import annotations``
    the annotations would be strings, which ``DistributedDataParallel._check_comm_hook`` rejects.)
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    span = state.record_launch(bucket.buffer().numel() * bucket.buffer().element_size())
    fut = allreduce_hook(None, bucket)

    def done(f):
        span[1] = time.perf_counter()
        return f.value()

    return fut.then(done)


def make_strategy(args: argparse.Namespace) -> Any:
    """``HierSlicedStrategy`` with the requested bucketing (one device per node), or DDP."""
    if args.strategy == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy()  # Lightning's defaults (25 MiB buckets, 1 MiB first bucket)
    from lightning_hier import HierSlicedStrategy

    kwargs: dict[str, Any] = {}
    if args.strategy == "time":
        kwargs.update(
            {k: getattr(args, k) for k in ("profile_steps", "profile_warmup_steps", "min_bucket_mb")}
        )
    if args.bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = args.bucket_cap_mb
    return HierSlicedStrategy(devices_per_node=1, bucketing=args.strategy, **kwargs)


def main() -> None:
    """Train and, on rank 0, write the timings."""
    args = cli.parser(__doc__, OPTIONS).parse_args()
    setup(interop_threads=True)
    world_size = int(os.environ["WORLD_SIZE"])
    if args.pid_dir is not None:
        (args.pid_dir / f"rank{os.environ.get('RANK', '0')}.pid").write_text(str(os.getpid()))
    warmup = args.warmup
    if args.strategy == "time":
        warmup += args.profile_warmup_steps + args.profile_steps
    total_steps = warmup + args.steps + 1

    model = MLP(args.hidden, args.layers, lr=1e-4)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gen = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))
    batch = tuple(torch.randn(args.batch_size, args.hidden, generator=gen) for _ in range(2))
    # the same batch every step (data loading is not what is measured); no distributed sampler
    loader = torch.utils.data.DataLoader([batch] * total_steps, batch_size=None)
    recorder = StepRecorder(args.strategy, warmup, args.steps, args.pid_dir)
    trainer = quiet_trainer(
        devices=1,
        num_nodes=world_size,
        strategy=make_strategy(args),
        max_steps=total_steps,
        use_distributed_sampler=False,
        callbacks=[recorder],
    )
    t0 = time.perf_counter()
    trainer.fit(model, loader)
    if trainer.global_rank == 0:
        result = {
            "strategy": args.strategy,
            "strategy_class": type(trainer.strategy).__name__,
            "world_size": world_size,
            **{k: getattr(args, k) for k in ("hidden", "layers", "batch_size")},
            "warmup": warmup,
            "steps": args.steps,
            "grad_bytes": grad_bytes,
            "fit_s": time.perf_counter() - t0,
            **recorder.summary(),
        }
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None and engine.time_bucketing is not None:
            result["plans_made_at_end"] = engine.time_bucketing.plans_made
            plan = engine.time_bucketing.plan
            result["plan_at_end"] = plan.describe() if plan is not None else None
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
