"""A stage process of ``bench_pipeline.py`` and ``bench_pipeline_memory.py``: ``... CONFIG_JSON JOB_DIR``."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _pipeline_gpt2 as gpt2
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from harness.jobs import cpu_snapshot, other_cores
from harness.worker import quiet_trainer, setup
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import HierPipelineStrategy

WIDTH = 256  # what every block takes and returns
MODELS = {  # hidden widths of the 16 blocks
    "heavy-first": [1024] * 8 + [32] + [16] * 7,  # the benchmark's default
    "narrow-first": [32] * 9 + [512] * 7,  # the skewed stack: 9 narrow blocks, then 7 wide ones
}
HIDDENS = list(MODELS["heavy-first"])
SGD = {"lr": 0.01, "momentum": 0.9}
NAN = float("nan")


class Block(nn.Module):
    """``x + fc2(act(fc1(x)))``: costs grow with ``hidden``; the skip connection makes it one cluster."""

    def __init__(self, width: int, hidden: int, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class Net(pl.LightningModule):
    """``blocks`` in a row, then ``head`` if there is one; ``loss``, plain SGD with ``sgd`` settings."""

    def __init__(self, blocks: list[Block], head: nn.Module | None, loss: Callable, **sgd: float) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*blocks)
        self.head = head
        self.loss = loss
        self.sgd = sgd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(x)
        return x if self.head is None else self.head(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), **self.sgd)


def skewed_mlp() -> Net:
    """The benchmark's model: the blocks of ``HIDDENS``, MSE, SGD with momentum."""
    blocks = [Block(WIDTH, hidden, torch.tanh) for hidden in HIDDENS]
    return Net(blocks, None, nn.functional.mse_loss, **SGD)


def make_batches(batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """4 seeded ``(x, y)`` batches (cycled), the same in every job."""
    g = torch.Generator().manual_seed(1234)
    draw = lambda: torch.randn(batch_size, WIDTH, generator=g)
    return [(draw(), draw()) for _ in range(4)]


def model_and_batches(c: dict[str, Any]) -> tuple[pl.LightningModule, list[tuple[torch.Tensor, ...]]]:
    """The job's LightningModule (``c["model"]``: the MLP stack or the GPT-2) and its batches."""
    if c.get("model") == "gpt2":
        return gpt2.GPT2LM(), gpt2.make_batches(c["batch_size"])
    return skewed_mlp(), make_batches(c["batch_size"])


def max_over_mean(times: list[float] | None) -> float:
    """max/mean of stage times (nan when there are none)."""
    return max(times) / statistics.fmean(times) if times and sum(times) > 0 else float("nan")


class Window:
    """Rank 0 times ``steps`` steps start to start between barriers, and the CPU that other processes used."""

    def __init__(self, steps: int, job_dir: Path) -> None:
        self.steps = steps
        self.job_dir = job_dir
        self.start: int | None = None
        self.step_starts: list[float] = []
        self.losses: list[float] = []
        self.edges: list[tuple[float, float, float]] = []

    def step(self, index: int, opens: bool) -> str | None:
        """Record a step start; open the window (``opens``) or close it: returns "open" or "close" there."""
        self.step_starts.append(time.perf_counter())
        if self.start is None and opens:
            self.start = index
        elif self.start is None or index != self.start + self.steps:
            return None
        dist.barrier()
        if dist.get_rank() == 0:  # the CPU of this process and of the other ranks
            others = [int(f.read_text()) for f in self.job_dir.glob("pid.*") if f.name != "pid.0"]
            self.edges.append(cpu_snapshot(others))
        return "open" if index == self.start else "close"

    def result(self, batch_size: int) -> dict[str, Any]:
        """Rank 0's timings, the CPU other processes used in the window (in cores), the first loss."""
        seconds = self.edges[1][0] - self.edges[0][0]
        return {
            "window_start_step": self.start,
            "steps": self.steps,
            "window_s": seconds,
            "samples_per_s": self.steps * batch_size / seconds,
            "other_cores": other_cores(*self.edges),
            "all_step_times_s": [b - a for a, b in zip(self.step_starts, self.step_starts[1:])],
            "first_loss": self.losses[0],
        }


# ---------------------------------------------------------------------- hier_pipeline
class StepParts:
    """Where this stage's steps go: the strategy's ``training_step`` (the schedule, the loss broadcast),
    what follows it up to the end of ``optimizer_step`` (Lightning's backward hooks, the optimizer's own
    step, a rebalance check when due), and the rest (Lightning between steps, the batch)."""

    def __init__(self, strategy: HierPipelineStrategy) -> None:
        self.seconds = {"training_step": 0.0, "optimizer_step": 0.0}
        self.counting = False
        self._training_end = 0.0
        training_step, optimizer_step = strategy.training_step, strategy.optimizer_step

        def timed_training_step(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return training_step(*args, **kwargs)
            finally:
                self._training_end = time.perf_counter()
                if self.counting:
                    self.seconds["training_step"] += self._training_end - start

        def timed_optimizer_step(*args: Any, **kwargs: Any) -> Any:
            try:
                return optimizer_step(*args, **kwargs)
            finally:
                if self.counting:
                    self.seconds["optimizer_step"] += time.perf_counter() - self._training_end

        strategy.training_step, strategy.optimizer_step = timed_training_step, timed_optimizer_step

    def per_step_ms(self, steps: int, window_s: float) -> dict[str, float]:
        parts = {name: seconds / steps * 1e3 for name, seconds in self.seconds.items()}
        parts["between_steps"] = window_s / steps * 1e3 - sum(parts.values())
        return parts


class EngineParts:
    """Inside the engine's step of one stage: the time blocked on a neighbour (exchanges, header reads,
    the step's final send completion) and the rest. The rest, less the stage's layers' own measured
    times, is the engine's own work (schedule, interpreter, messages' Python, timing). A split backward's
    weights' passes run inside exchanges while messages are in flight: they count as layers, not waiting."""

    def __init__(self, engine: Any) -> None:
        self.step_s = self.wait_s = self.filled_s = 0.0
        self.counting = False
        link = engine.link
        engine.train_step = self._timed(engine.train_step, "step_s")
        for name in ("exchange", "recv_header", "wait"):
            setattr(link, name, self._timed(getattr(link, name), "wait_s"))
        split = engine.executor.weight_grads
        if split is not None:
            run_oldest = split.run_oldest

            def timed_run_oldest() -> None:
                start = time.perf_counter()
                try:
                    run_oldest()
                finally:
                    if self.counting and self.waiting:
                        self.filled_s += time.perf_counter() - start

            split.run_oldest = timed_run_oldest
        self.waiting = False

    def _timed(self, fn: Callable[..., Any], into: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            self.waiting = into == "wait_s"
            try:
                return fn(*args, **kwargs)
            finally:
                self.waiting = False
                if self.counting:
                    setattr(self, into, getattr(self, into) + time.perf_counter() - start)

        return timed

    def per_micro_batch_ms(self, steps: int, micro: int) -> dict[str, float]:
        """Per micro-batch of the window: the engine's step and the time it was blocked on a neighbour."""
        step, wait = (value / (steps * micro) * 1e3 for value in (self.step_s, self.wait_s - self.filled_s))
        return {"engine_step": step, "waiting": wait}


class HierWindow(pl.Callback):
    """Opens the window after ``warmup`` steps or (rebalancing) once a check left the split unchanged."""

    def __init__(self, strategy: HierPipelineStrategy, c: dict[str, Any], window: Window) -> None:
        self.strategy = strategy
        self.c = c
        self.window = window
        self.settled = False
        self.stage_times: list[float] = []
        self.parts = StepParts(strategy)
        self.parts_by_stage: list[dict[str, float]] = []
        self._opened = 0.0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.c["rebalance"] == "never":  # nothing reads layer times: sample them for the report
            self.strategy.engine.layer_timing = "sampled"
        self.engine_parts = EngineParts(self.strategy.engine)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        engine = self.strategy.engine
        decision = engine.last_decision  # the same on every rank: the engine broadcasts it
        opens = False
        if self.window.start is None and self.c["rebalance"] == "never":
            opens = batch_idx == self.c["warmup"]
        elif self.window.start is None:
            self.settled = decision is not None and decision.new is None and bool(engine.history)
            opens = self.settled or batch_idx >= self.c["max_settle_steps"]
        edge = self.window.step(batch_idx, opens)
        if edge == "open":
            if self.c["rebalance"] == "never":  # the window's own layer times for the report
                engine.executor.reset_times()
            # rebalancing: the window opens after a check that moved nothing, whose times carry on aged
            # (as they would for a user); dropping them would start a burst of full timing
            self.parts.counting, self._opened = True, time.perf_counter()
            self.engine_parts.counting = True
        elif edge == "close":
            self.parts.counting = self.engine_parts.counting = False
            parts = self.parts.per_step_ms(self.window.steps, time.perf_counter() - self._opened)
            inside = self.engine_parts.per_micro_batch_ms(self.window.steps, self.c["micro_batches"])
            mine_parts = {"stage": engine.stage, **parts, "per_micro_batch": inside}
            all_parts: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(all_parts, mine_parts)
            self.parts_by_stage = sorted(all_parts, key=lambda part: part["stage"])
            if self.c["rebalance"] == "never":  # per stage: its layers' mean forward + backward
                mine = (engine.stage, sum(f + b for f, b in engine.local_times()["layers"].values()))
                gathered: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, mine)
                self.stage_times = [t for _, t in sorted(gathered)]
            trainer.should_stop = True

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *args: Any) -> None:
        self.window.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


def run_hier(c: dict[str, Any], job_dir: Path) -> dict[str, Any] | None:
    """``HierPipelineStrategy`` from the uniform split, rebalanced every ``c["rebalance"]`` steps or never."""
    every = c["rebalance"]
    steps = c["steps"] if every == "never" else -(-c["steps"] // every) * every  # whole check intervals
    strategy = HierPipelineStrategy(
        micro_batches=c["micro_batches"],
        partition="uniform",
        rebalance=every,
        static_shapes=c.get("static_shapes", False),
    )
    strategy._split_backward = c.get("split_backward", False)  # a tuning attribute
    timer = HierWindow(strategy, c, Window(steps, job_dir))
    max_steps = c["max_settle_steps"] + steps + c["warmup"] + 10
    model, batches = model_and_batches(c)
    data = DataLoader([batches[i % len(batches)] for i in range(max_steps)], batch_size=None)
    world = int(os.environ["WORLD_SIZE"])
    trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=max_steps, callbacks=[timer])
    trainer.fit(model, data)
    if trainer.global_rank != 0:
        return None
    micro = c["micro_batches"]
    engine, history = strategy.engine, [event.to_dict() for event in strategy.engine.history]
    start = timer.window.start
    checks = [check for check in engine.checks if start < check["step"] <= start + steps]  # in the window
    stage_times = timer.stage_times
    if every != "never":
        if not checks:
            raise RuntimeError("no rebalance check inside the window")
        stage_times = [statistics.fmean(ts) for ts in zip(*(check["stage_times"] for check in checks))]
    window = timer.window.result(c["batch_size"])
    # the step an ideal pipeline of these stage times takes: the slowest stage runs every micro-batch, and
    # one micro-batch passes through the others on the way in and out (fill and drain); balanced stages:
    # (micro + stages - 1) x the stage time
    ideal_s = (micro - 1) * max(stage_times) + sum(stage_times) if stage_times else NAN
    # the optimizer's own step (with Lightning's hooks around it) is the model's work, not the engine's:
    # the overhead once the slowest stage's part is taken out of the step too
    optimizer_ms = max(part["optimizer_step"] for part in timer.parts_by_stage)
    parts = timer.parts_by_stage
    for part, layers_s in zip(parts, stage_times):  # the layers' own forward + backward per micro-batch
        inside = part["per_micro_batch"]
        inside["layers"] = layers_s * 1e3
        inside["engine_own"] = inside["engine_step"] - inside["waiting"] - inside["layers"]
    # the step boundary on the first stage lies on every 1F1B or GPipe step's critical path: its last
    # backward ends the step and its first forward starts the next, with its optimizer step and Lightning's
    # loop in between; the last stage's boundary overlaps the first stage's last backward
    first = parts[0]
    boundary_s = (first["optimizer_step"] + first["between_steps"]) / 1e3
    # balanced: the same stage times summed, shared evenly (no split at block granularity does better)
    balanced_s = (micro + len(stage_times) - 1) * sum(stage_times) / len(stage_times) if stage_times else NAN
    return {
        **window,
        "ideal_step_s": ideal_s,
        "first_stage_boundary_s": boundary_s,
        "balanced_ideal_step_s": balanced_s,
        "engine_overhead_ms_per_micro_batch": (window["window_s"] / steps - ideal_s) / micro * 1e3,
        # the engine's own work per micro-batch on its busiest stage: its step less waits and layers
        "engine_own_ms_per_micro_batch": max(part["per_micro_batch"]["engine_own"] for part in parts),
        "step_parts_ms_by_stage": timer.parts_by_stage,
        "engine_overhead_without_optimizer_ms_per_micro_batch": (
            (window["window_s"] / steps - ideal_s) * 1e3 - optimizer_ms
        )
        / micro,
        "settled": timer.settled,
        "final_starts": list(engine.partition.starts),
        "num_clusters": engine.graph.num_clusters,
        # the module of each cluster's first layer: where torch's hand-built stages begin (--model gpt2)
        "cluster_owners": [engine.graph.layers[cluster.start].owner for cluster in engine.graph.clusters],
        "extra_warmup": list(engine.schedule.extra_warmup),  # extra 1F1B warm-up forwards per stage
        "stage_times_s": stage_times,  # per micro-batch: the window's checks', or (never) since it opened
        "window_checks": checks,
        "max_mean_before": max_over_mean(history[0]["stage_times"] if history else None),  # uniform split
        "max_mean_after": max_over_mean(stage_times),
        "pause_s": sum(event["pause_seconds"] for event in history),
        "history": history,
    }


# ---------------------------------------------------------------------- torch.distributed.pipelining
def run_pipelining(c: dict[str, Any], job_dir: Path) -> dict[str, Any] | None:
    """``PipelineStage``s built by hand on ``c["split"]`` (first block, or with ``--model gpt2`` first
    cluster, of every stage), ``Schedule1F1B``."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    starts = c["split"]
    torch.manual_seed(0)
    tied: torch.Tensor | None = None
    if c.get("model") == "gpt2":
        model = gpt2.gpt2()
        mine: nn.Module = gpt2.hand_stages(model, gpt2.pieces_of_split(starts, c["cluster_owners"]))[rank]
        loss_fn, batches = gpt2.next_token_loss, gpt2.make_batches(c["batch_size"])
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(mine.parameters(), **gpt2.ADAMW)
        # the input and output embeddings share a weight: on different stages each holds a replica, and
        # both step with the sum of the two gradients, as hier_pipeline's tied parameters do
        ends = dist.new_group([0, world - 1]) if world > 2 else None
        if gpt2.tied_weight(model) is not None and rank in (0, world - 1):
            tied = gpt2.tied_weight(model)
    else:
        blocks = skewed_mlp().blocks[starts[rank] : [*starts, len(HIDDENS)][rank + 1]]  # of the whole model
        mine = nn.Sequential(*blocks)
        loss_fn, batches = nn.functional.mse_loss, make_batches(c["batch_size"])
        optimizer = torch.optim.SGD(mine.parameters(), **SGD)
    stage = PipelineStage(mine, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, c["micro_batches"], loss_fn=loss_fn)
    window = Window(c["steps"], job_dir)
    for step in range(c["warmup"] + c["steps"] + 1):
        if window.step(step, step == c["warmup"]) == "close":
            break
        x, y = batches[step % len(batches)]
        optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        if tied is not None and tied.grad is not None:
            dist.all_reduce(tied.grad, group=ends)
        optimizer.step()
        if losses:
            window.losses.append(float(torch.stack(losses).mean()))
    last_rank_losses: list[Any] = [window.losses]  # the loss lives on the last rank
    dist.broadcast_object_list(last_rank_losses, src=world - 1)
    window.losses = last_rank_losses[0]
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    owners = c.get("cluster_owners")
    split = {"num_clusters": len(owners), "cluster_owners": owners} if owners else {}
    return {**window.result(c["batch_size"]), "final_starts": starts, **split}


# ---------------------------------------------------------------------- one process, no pipeline
class SingleWindow(pl.Callback):
    """The window of ``Window`` around a single process's steps (the loss is logged by the step)."""

    def __init__(self, c: dict[str, Any], window: Window) -> None:
        self.c = c
        self.window = window

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.window.step(batch_idx, batch_idx == self.c["warmup"]) == "close":
            trainer.should_stop = True

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *args: Any) -> None:
        self.window.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


def run_single(c: dict[str, Any], job_dir: Path) -> dict[str, Any]:
    """The same model, batches and optimizer in one Lightning process (no strategy of ours)."""
    dist.init_process_group("gloo")  # only for the window's barriers
    window = Window(c["steps"], job_dir)
    max_steps = c["warmup"] + c["steps"] + 2
    model, batches = model_and_batches(c)
    data = DataLoader([batches[i % len(batches)] for i in range(max_steps)], batch_size=None)
    trainer = quiet_trainer(devices=1, max_steps=max_steps, callbacks=[SingleWindow(c, window)])
    trainer.fit(model, data)
    dist.destroy_process_group()
    return {**window.result(c["batch_size"]), "final_starts": [0]}


# ---------------------------------------------------------------------- memory policy
class Clock(pl.Callback):
    """Times every step, start to end; resets the stage's activation peak where the measured steps start."""

    def __init__(self, strategy: HierPipelineStrategy, warmup: int) -> None:
        self.strategy = strategy
        self.warmup = warmup
        self.step_times: list[float] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.start = time.perf_counter()
        if batch_idx == self.warmup and self.strategy.engine is not None and self.strategy.engine.meter:
            self.strategy.engine.meter.reset_peak()

    def on_train_batch_end(self, *args: Any) -> None:
        self.step_times.append(time.perf_counter() - self.start)


def run_memory(c: dict[str, Any], job_dir: Path) -> dict[str, Any] | None:
    """``c["policy"]`` under ``c["memory_limit"]``: each stage's measured peak and plan, the step times."""
    width, blocks, warmup, steps = c["width"], c["blocks"], c["warmup"], c["warmup"] + c["steps"]
    g = torch.Generator().manual_seed(0)
    n = c["batch_size"] * steps
    data = TensorDataset(torch.randn(n, width, generator=g), torch.randint(0, 10, (n,), generator=g))
    pl.seed_everything(0, verbose=False)
    strategy = HierPipelineStrategy(
        micro_batches=c["micro_batches"],
        partition="uniform",
        rebalance="never",
        profile_steps=warmup - 1,
        leaf_modules=[f"blocks.{i}" for i in range(blocks)],
        activation_policy=c["policy"],
        memory_limit=c.get("memory_limit"),
    )
    clock, world = Clock(strategy, warmup), int(os.environ["WORLD_SIZE"])
    trainer = quiet_trainer(devices=world, strategy=strategy, max_steps=steps, callbacks=[clock])
    layers = [Block(width, 4 * width, nn.functional.gelu) for _ in range(blocks)]
    model = Net(layers, nn.Linear(width, 10), nn.functional.cross_entropy, lr=1e-3)
    trainer.fit(model, DataLoader(data, batch_size=c["batch_size"]))
    engine, executor = strategy.engine, strategy.engine.executor
    layer_times = executor.times.summary(executor.layer_range).values()  # forward, backward seconds
    mine = {
        "stage": engine.stage,
        "base_bytes": engine.base_bytes(),
        "activation_peak_bytes": engine.meter.peak_bytes,
        "measured_peak_bytes": engine.measured_peak_bytes(),
        "plan": str(engine.memory_plan) if engine.memory_plan is not None else c["policy"],
        "policies": dict(executor.policies),
        "compute_s_per_micro_batch": sum(f + b for f, b in layer_times),  # its own layers, no waiting
    }
    stages: list[Any] = [None] * world
    dist.all_gather_object(stages, mine)
    if not trainer.is_global_zero:
        return None
    measured = clock.step_times[warmup:]
    return {
        "config": c,
        "stages": sorted(stages, key=lambda s: s["stage"]),
        "step_times_s": measured,
        "samples_per_s": c["batch_size"] * len(measured) / sum(measured),
    }


def main() -> None:
    """Pin every thread to core ``LOCAL_RANK mod cores`` (``pin``), write the pid, run ``mode``."""
    c, job_dir = json.loads(sys.argv[1]), Path(sys.argv[2])
    setup()  # one thread, no warnings, seed 0: the same weights in every job
    if c.get("pin"):
        core = int(os.environ["LOCAL_RANK"]) % (os.cpu_count() or 1)
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), {core})
    (job_dir / f"pid.{os.environ['RANK']}").write_text(str(os.getpid()))
    HIDDENS[:] = MODELS.get(c.get("model", "heavy-first"), HIDDENS)
    modes = {"hier": run_hier, "pipelining": run_pipelining, "memory": run_memory, "single": run_single}
    result = modes[c["mode"]](c, job_dir)
    if result is not None:
        (job_dir / "rank0.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
