"""One training process of ``bench_hier_sliced.py`` and ``bench_time_buckets.py``: the MLP with ``ddp``
(optionally torch's bf16 compression hook), ``hier_sliced``, ``hier_bsp`` or torch FSDP2 HSDP (a plain torch
loop), on the same batch every step (no data loading); what it measures: benchmarks/README.md."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from harness import cli
from harness.jobs import BUSY_HOST_CORES, host_busy_seconds, process_cpu_seconds
from harness.worker import MLP, MarkedWindow, quiet_trainer, setup
from lightning import Callback, LightningModule, Trainer
from torch.autograd import Variable

OPTIONS = """
--config   str   required  the driver's settings, as JSON (see main)
--job-dir  path  required  marker files, pid.<rank>
--out      path  required  JSON timings (written by rank 0)
"""
MEANS = ("backward_s", "comm_union_s", "hidden_fraction", "exposed_s")


def comm_record(backward: float, launch: list[float], done: list[float], sizes: list[int]) -> dict[str, Any]:
    """Bucket spans (s after backward start): their union, its part before backward ended, what is exposed."""
    total, hidden, cursor = 0.0, 0.0, float("-inf")
    for start, end in sorted(zip(launch, done)):
        start = max(start, cursor)
        if end > start:
            total += end - start
            hidden += max(0.0, min(end, backward) - start)
            cursor = end
    return {
        "backward_s": backward,
        "bucket_launch_s": launch,
        "bucket_done_s": done,
        "bucket_bytes": sizes,
        "comm_union_s": total,
        "hidden_fraction": hidden / total if total > 0 else 0.0,
        "exposed_s": max(0.0, max(done, default=0.0) - backward),
    }


class StepRecorder(MarkedWindow):
    """The measured window (no hand-over), plus the time plan and per step the buckets' spans and the CPU
    use. Under ``ddp`` a comm hook times the all-reduces, and an autograd callback the end of backward."""

    def __init__(self, first: int, steps: int, job_dir: Path) -> None:
        super().__init__(first, steps, signal_dir=None)
        self.job_dir = job_dir
        self.pids = [os.getpid()]
        self.cpu_marks: list[tuple[float, float]] = []  # (host busy s, the workers' CPU s) per step start
        self.records: list[dict[str, Any]] = []
        self.engine: Any = None  # hier_sliced's
        self.timing: Any = None  # its time bucketing
        self.plan: dict[str, Any] | None = None
        self.plans_at_start: int | None = None
        self.backward: list[float] = []  # ddp: backward start, end of the autograd graph
        self.spans: list[list[float]] = []  # ddp: [launch, done, bytes] per bucket

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """ddp: install the timing comm hook, and the gradient hooks that mark the end of backward."""
        self.engine = getattr(trainer.strategy, "engine", None)
        self.timing = getattr(self.engine, "time_bucketing", None)
        if self.engine is None:
            trainer.strategy.model.register_comm_hook(state=self, hook=_timed_allreduce_hook)
            for param in pl_module.parameters():
                param.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if len(self.backward) == 1:  # the first gradient of this backward
            self.backward.append(float("nan"))
            Variable._execution_engine.queue_callback(self._on_graph_done)

    def _on_graph_done(self) -> None:
        self.backward[1] = time.perf_counter()

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        """Start of backward: a new ddp timeline."""
        self.backward = [time.perf_counter()]
        self.spans = []

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """At the first measured step, read every worker's pid and the time plan."""
        if batch_idx == self.first:
            self.pids = [int(f.read_text()) for f in sorted(self.job_dir.glob("pid.*"))]
            if self.timing is not None:
                self._record_plan()
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def mark_step(self) -> None:
        """A step start, with the host's and the workers' CPU time."""
        self.cpu_marks.append((host_busy_seconds(), process_cpu_seconds(self.pids)))
        super().mark_step()

    def _record_plan(self) -> None:
        if self.timing.plan is None:
            raise RuntimeError(
                f"bucketing='time' has no plan at batch {self.first}: the measured window would "
                "include profiling; raise --warmup"
            )
        plan, self.plans_at_start = self.timing.plan, self.timing.plans_made
        self.plan = {"describe": plan.describe(), "backward_seconds": plan.backward_seconds}

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Record the buckets of a measured step."""
        if not self.first <= batch_idx < self.first + self.steps:
            return
        if self.engine is None:
            start = self.backward[0]
            launch, done = ([s[i] - start for s in self.spans] for i in (0, 1))
            record = comm_record(self.backward[1] - start, launch, done, [int(s[2]) for s in self.spans])
        else:
            tl = self.engine.last_timeline
            launch, done, sizes = list(tl.bucket_launch), list(tl.bucket_done), list(tl.bucket_bytes)
            record = comm_record(tl.backward_seconds, launch, done, sizes)
            record["hidden_fraction"] = tl.hidden_fraction()  # the engine's own
        self.records.append({**record, "batch_idx": batch_idx})

    def summary(self) -> dict[str, Any]:
        """Timings of the measured window."""
        window = super().summary()
        if len(self.records) != self.steps:
            raise RuntimeError(f"expected {self.steps} measured steps, recorded {len(self.records)}")
        marks = list(zip(self.cpu_marks, self.cpu_marks[1:]))
        ours = [b[1] - a[1] for a, b in marks]
        steps = window["step_times_s"]
        other = [max(0.0, b[0] - a[0] - w) / dt for (a, b), w, dt in zip(marks, ours, steps)]
        return {
            **window,
            "other_cpu_cores_per_step": other,  # cores that other processes used during each step
            "other_cpu_cores": sum(o * t for o, t in zip(other, steps)) / sum(steps),
            "quiet_step_times_s": [t for t, o in zip(steps, other) if o <= BUSY_HOST_CORES],
            **{f"mean_{key}": statistics.fmean(r[key] for r in self.records) for key in MEANS},
            "num_buckets": len(self.records[-1]["bucket_launch_s"]),
            "plan": self.plan,
            "plans_made_at_start": self.plans_at_start,
            "plans_made_at_end": self.timing.plans_made if self.timing else None,
            "steps": self.records,
        }


def _timed_allreduce_hook(state, bucket):  # unannotated: DDP's _check_comm_hook rejects string annotations
    """DDP's default ``allreduce_hook``; ``state`` (the recorder) gets its launch and completion times."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    nbytes = bucket.buffer().numel() * bucket.buffer().element_size()
    span = [time.perf_counter(), float("nan"), float(nbytes)]
    state.spans.append(span)

    def done(fut):
        span[1] = time.perf_counter()
        return fut.value()

    return allreduce_hook(None, bucket).then(done)


def _bf16_compress_hook(state, bucket):  # unannotated, as _timed_allreduce_hook
    """torch's ``bf16_compress_hook`` itself. DDP refuses that function by its name unless CUDA and NCCL
    are present; the cast, the division and the all-reduce are the same on gloo, so this wrapper lets the CPU
    benchmark run it."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    return bf16_compress_hook(state, bucket)


class Bf16CompressHook(Callback):
    """Registers torch's bf16 compression hook on the DDP model. Lightning's ``ddp_comm_hook`` option does
    not: it registers hooks on CUDA only."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Before the first backward."""
        trainer.strategy.model.register_comm_hook(state=None, hook=_bf16_compress_hook)


class LossLog(Callback):
    """Every step's training loss (this rank's)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, module: LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


def make_strategy(name: str, options: dict[str, Any]) -> Any:
    """Lightning's DDP, or a HierSlicedStrategy or HierBSPStrategy (imported only then), with ``options``: a
    ``bucketing`` dict holds a TimeBuckets' fields, names starting with ``_`` are tuning attributes."""
    if name in ("ddp", "ddp_bf16"):
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(**options)  # ddp_bf16: its hook comes with Bf16CompressHook
    import lightning_hier

    strategy_class = {
        "hier_sliced": lightning_hier.HierSlicedStrategy,
        "hier_bsp": lightning_hier.HierBSPStrategy,
    }[name]
    options = dict(options)
    if isinstance(options.get("bucketing"), dict):
        options["bucketing"] = lightning_hier.TimeBuckets(**options["bucketing"])
    tuning = {key: options.pop(key) for key in list(options) if key.startswith("_")}
    strategy = strategy_class(devices_per_node=int(os.environ["LOCAL_WORLD_SIZE"]), **options)
    for key, value in tuning.items():
        setattr(strategy, key, value)
    return strategy


def fit_hsdp(
    model: MLP, batch: tuple[torch.Tensor, ...], window: MarkedWindow, total: int, lr: float
) -> list[float]:
    """Train ``model.net`` for ``total`` steps under torch FSDP2 as HSDP: a 2-D mesh (replicate across
    nodes, shard inside a node), every Linear its own unit, parameters kept gathered from forward to backward
    (``reshard_after_forward=False``); plain SGD as the MLP's. Returns the losses of every step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    devices, world = int(os.environ["LOCAL_WORLD_SIZE"]), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // devices, devices), mesh_dim_names=("replicate", "shard"))
    for layer in model.net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model.net, mesh=mesh, reshard_after_forward=False)
    optimizer = torch.optim.SGD(model.net.parameters(), lr=lr)
    handover = SimpleNamespace(global_rank=dist.get_rank())  # what MarkedWindow reads of a Trainer
    losses = []
    x, y = batch
    for step in range(total):
        window.on_train_batch_start(handover, model, batch, step)  # type: ignore[arg-type]
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model.net(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    dist.destroy_process_group()
    return losses


def main() -> None:
    """Train with ``--config`` (``strategy``: ``ddp``, ``ddp_bf16``, ``hier_sliced``, ``hier_bsp`` or
    ``hsdp``; ``strategy_options``, ``record``: ``handover`` or ``buckets``, ``hidden``, ``layers``,
    ``batch_size``, ``lr``, ``warmup``, ``steps``, optional ``comm_profiler``: true adds a CommProfiler whose
    rows, every rank's, go into the JSON as ``comm_profile``); rank 0 writes the timings and the losses."""
    args = cli.parser(__doc__, OPTIONS).parse_args()
    config = json.loads(args.config)
    setup(interop_threads=True)
    rank, devices, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE"))
    (args.job_dir / f"pid.{rank}").write_text(str(os.getpid()))
    gen = torch.Generator().manual_seed(rank)
    batch = tuple(torch.randn(config["batch_size"], config["hidden"], generator=gen) for _ in range(2))
    first, steps = config["warmup"], config["steps"]
    window = (StepRecorder if config["record"] == "buckets" else MarkedWindow)(first, steps, args.job_dir)
    model = MLP(config["hidden"], config["layers"], lr=config["lr"])
    # counted before fit: a strategy may lay the parameters out anew
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    total = first + steps + 1
    if config["strategy"] == "hsdp":
        t0 = time.perf_counter()
        every_loss = fit_hsdp(model, batch, window, total, config["lr"])
        if rank == 0:
            result = {**config, "strategy_class": "torch FSDP2 (fully_shard, HSDP mesh)", "world_size": world}
            result.update(num_nodes=world // devices, devices_per_node=devices, grad_bytes=grad_bytes)
            result.update(fit_s=time.perf_counter() - t0, **window.summary())
            result.update(losses=every_loss[first : first + steps], first_loss=every_loss[0])
            result["last_loss"] = every_loss[-1]
            args.out.write_text(json.dumps(result, indent=2))
        return
    losses = LossLog()
    callbacks: list[Callback] = [window, losses]
    if config["strategy"] == "ddp_bf16":
        callbacks.append(Bf16CompressHook())
    if config.get("comm_profiler"):  # after the window: its hand-over barriers fall between profiled steps
        from lightning_hier import CommProfiler

        callbacks.append(CommProfiler(output_dir=str(args.job_dir), save_figure=False, print_summary=False))
    trainer = quiet_trainer(
        devices=devices,
        num_nodes=world // devices,
        strategy=make_strategy(config["strategy"], config["strategy_options"]),
        max_epochs=1,  # not max_steps, which hier_bsp refuses: its workers take different numbers of steps
        use_distributed_sampler=False,  # the same batch every step, on every rank its own
        callbacks=callbacks,
    )
    t0 = time.perf_counter()
    trainer.fit(model, torch.utils.data.DataLoader([batch] * total, batch_size=None))
    if trainer.global_rank == 0:
        result = {**config, "strategy_class": type(trainer.strategy).__name__, "world_size": world}
        result.update(num_nodes=world // devices, devices_per_node=devices, grad_bytes=grad_bytes)
        result.update(fit_s=time.perf_counter() - t0, **window.summary())
        result["losses"] = losses.losses[first : first + steps]
        result.update(first_loss=losses.losses[0], last_loss=losses.losses[-1])
        if config.get("comm_profiler"):
            result["comm_profile"] = callbacks[-1].rows
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
