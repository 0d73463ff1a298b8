"""One stage process of ``bench_pipeline.py`` (launched P times by ``torch.distributed.run``).

Every mode trains the same model on the same data: 16 residual MLP blocks
``x + Linear(hidden, width)(tanh(Linear(width, hidden)(x)))`` (:class:`Block`, ``--width`` 256)
whose first ``--heavy-blocks`` (8) have a wide hidden layer (``--heavy-hidden``, 1024) and the rest
a narrow one (``--light-hidden``, 32 then 16), so the heavy blocks sit together; MSE loss against
random targets, SGD (lr 0.01, momentum 0.9), ``--batch-size`` samples per step split into
``--micro-batches`` micro-batches, cycling over 4 pre-generated batches. Weights and data are
seeded, so every contender starts from the same weights, sees the same data and reports the
same first-step loss. ``torch.set_num_threads(1)``, gloo; ``--pin`` restricts every thread of rank
``r`` to core ``LOCAL_RANK mod cores``.

Modes:

* ``hier``: Lightning ``Trainer(accelerator="cpu", devices=P, strategy=HierPipelineStrategy(...))``
  with ``partition="uniform"`` and ``rebalance`` = ``never`` (the uniform-count split) or a number of
  steps (the rebalanced split). The skip connection makes every block one cluster (fx traces its
  four layers; a cut can only fall between blocks), so the uniform split gives every stage the same
  number of blocks; the worker checks that there are 16 clusters.
* ``pipelining``: plain torch, ``torch.distributed.pipelining.PipelineStage`` built by hand from the
  blocks ``[starts[r], starts[r + 1])`` on rank ``r`` and ``Schedule1F1B`` / ``ScheduleGPipe``
  with the same micro-batches; a static split (``--split``).

Timing (rank 0; all ranks meet in a barrier at both edges of the window, so the window covers
exactly ``--steps`` steps, start to start):

* ``hier`` uniform and ``pipelining``: the window starts after ``--warmup`` steps;
* ``hier`` rebalanced: the window starts at the first step after a rebalance check that left the
  split unchanged ("settled"), or after ``--max-settle-steps`` steps whatever happened (flagged). Its
  length is rounded up to a multiple of the check interval, so the window's checks cover it exactly.

Stage times (the engine's own measure: per micro-batch, the sum over the stage's layers of mean
forward + mean backward seconds) in the window: for the rebalanced run the mean of the window's
rebalance checks' ``stage_times``; for the uniform run (no checks) every stage sums its layer times
from the window's start (``executor.reset_times()`` there) to its end. Rank 0 also reports the CPU
time other processes used during the window (host busy time from ``/proc/stat`` minus the workers').
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

NUM_DATA_BATCHES = 4  # distinct pre-generated batches, cycled


# ---------------------------------------------------------------------- model and data
def hidden_widths(heavy_blocks: int, heavy_hidden: int, light_hidden: list[int], blocks: int) -> list[int]:
    """Hidden width of every block: ``heavy_blocks`` wide ones first, then the light widths (the last
    one repeated as needed)."""
    light = blocks - heavy_blocks
    if light < 0 or not light_hidden:
        raise ValueError("need heavy_blocks <= blocks and at least one light width")
    return [heavy_hidden] * heavy_blocks + [light_hidden[min(i, len(light_hidden) - 1)] for i in range(light)]


class Block(nn.Module):
    """Residual MLP block ``x + Linear(hidden, width)(tanh(Linear(width, hidden)(x)))``.

    Its cost grows with ``hidden`` while what leaves it is always ``width`` wide, so every cut
    between blocks carries the same bytes. The skip connection makes the block one cluster (a
    pipeline cut can only fall between blocks).
    """

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


def build_blocks(width: int, hiddens: list[int]) -> nn.ModuleList:
    return nn.ModuleList(Block(width, hidden) for hidden in hiddens)


class Batches(Dataset):
    """``length`` steps cycling over ``NUM_DATA_BATCHES`` pre-generated ``(x, y)`` batches."""

    def __init__(self, batch_size: int, in_features: int, out_features: int, length: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.items = [
            (
                torch.randn(batch_size, in_features, generator=g),
                torch.randn(batch_size, out_features, generator=g),
            )
            for _ in range(NUM_DATA_BATCHES)
        ]
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.items[index % NUM_DATA_BATCHES]


def make_lightning_module(args: argparse.Namespace, hiddens: list[int]) -> Any:
    import lightning.pytorch as pl

    class SkewedMLP(pl.LightningModule):
        """16 residual MLP blocks of very different hidden widths, the heavy (wide) ones first."""

        def __init__(self) -> None:
            super().__init__()
            self.blocks = build_blocks(args.width, hiddens)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=args.lr, momentum=0.9)

    return SkewedMLP()


# ---------------------------------------------------------------------- window bookkeeping
def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def host_busy_seconds() -> float:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (fields[0] + fields[1] + fields[2]) / os.sysconf("SC_CLK_TCK")


class Window:
    """Barrier-aligned window edges on every rank; rank 0 keeps the wall clock and the host load."""

    def __init__(self) -> None:
        self.t: list[float] = []
        self.cpu: list[float] = []
        self.host: list[float] = []

    def edge(self) -> None:
        dist.barrier()
        self.t.append(time.perf_counter())
        self.cpu.append(cpu_seconds())
        if dist.get_rank() == 0:
            self.host.append(host_busy_seconds())

    @property
    def seconds(self) -> float:
        return self.t[1] - self.t[0]

    def other_cores(self) -> float | None:
        """Cores used by processes outside this job during the window (collective: call on all ranks).

        Also keeps every rank's CPU seconds in the window (``rank_cpu_s``, rank 0 only).
        """
        mine = self.cpu[1] - self.cpu[0]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        self.rank_cpu_s = list(gathered)
        if dist.get_rank() != 0:
            return None
        return max(0.0, (self.host[1] - self.host[0]) - sum(gathered)) / max(self.seconds, 1e-9)


# ---------------------------------------------------------------------- hier_pipeline
def run_hier(args: argparse.Namespace, hiddens: list[int]) -> dict[str, Any] | None:
    from lightning.pytorch import Callback, Trainer

    from lightning_hier.strategies.hier_pipeline import HierPipelineStrategy

    world = int(os.environ["WORLD_SIZE"])
    rebalance: str | int = "never" if args.rebalance == "never" else int(args.rebalance)
    rebalancing = rebalance != "never"
    steps = args.steps
    if rebalancing:
        steps = -(-steps // int(rebalance)) * int(rebalance)
    strategy = HierPipelineStrategy(
        micro_batches=args.micro_batches,
        schedule=args.schedule,
        partition=split_to_counts(args.split, len(hiddens)) if args.split else "uniform",
        rebalance=rebalance,
        imbalance_threshold=args.imbalance_threshold,
    )

    class Timer(Callback):
        def __init__(self) -> None:
            self.window = Window()
            self.start: int | None = None
            self.end: int | None = None
            self.settled = False
            self.step_starts: list[float] = []
            self.losses: list[float] = []
            self.window_decisions: list[Any] = []
            self._seen: Any = None
            self.events_before_window = 0
            self.stage_times_window: list[float] | None = None
            self.other_cores: float | None = None

        def _window_starts_here(self, batch_idx: int) -> bool:
            if not rebalancing:
                return batch_idx == args.warmup
            engine = strategy.engine
            assert engine is not None
            # the same on every rank: last_decision and history are broadcast by the engine
            decision = engine.last_decision
            if decision is not None and decision.new is None and engine.history:
                self.settled = True
                return True
            return batch_idx >= args.max_settle_steps

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            engine = strategy.engine
            assert engine is not None
            self.step_starts.append(time.perf_counter())
            if self.start is None:
                if self._window_starts_here(batch_idx):
                    self.start = batch_idx
                    self.end = batch_idx + steps
                    self.events_before_window = len(engine.history)
                    self._seen = engine.last_decision
                    engine.executor.reset_times()
                    self.window.edge()
                return
            decision = engine.last_decision
            if decision is not None and decision is not self._seen and batch_idx <= self.end:
                self._seen = decision
                self.window_decisions.append(decision)
            if batch_idx == self.end:
                self.window.edge()
                self.other_cores = self.window.other_cores()
                if not rebalancing:
                    self.stage_times_window = gather_stage_times(engine)
                trainer.should_stop = True

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.losses.append(float(loss))

    model = make_lightning_module(args, hiddens)
    data = Batches(args.batch_size, args.width, args.width, length=100_000)
    timer = Timer()
    trainer = Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=args.max_settle_steps + steps + args.warmup + 10,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[timer],
    )
    t0 = time.perf_counter()
    trainer.fit(model, DataLoader(data, batch_size=None, shuffle=False, num_workers=0))
    fit_s = time.perf_counter() - t0
    if trainer.global_rank != 0:
        return None
    engine = strategy.engine
    assert engine is not None and timer.start is not None and timer.end is not None
    if len(timer.window.t) != 2:
        raise RuntimeError(f"the window did not close (edges {len(timer.window.t)})")
    graph = engine.graph
    if graph.num_clusters != len(hiddens):
        raise RuntimeError(f"expected one cluster per block ({len(hiddens)}), got {graph.num_clusters}")
    if rebalancing:
        decisions = timer.window_decisions
        if not decisions:
            raise RuntimeError("no rebalance check inside the window")
        per_stage = list(zip(*(d.stage_times for d in decisions)))
        stage_times = [statistics.fmean(ts) for ts in per_stage]
    else:
        assert timer.stage_times_window is not None
        stage_times = timer.stage_times_window
    history = [event.to_dict() for event in engine.history]
    step_times = [b - a for a, b in zip(timer.step_starts, timer.step_starts[1:])]
    return {
        "fit_s": fit_s,
        "window_start_step": timer.start,
        "steps": steps,
        "window_s": timer.window.seconds,
        "samples_per_s": steps * args.batch_size / timer.window.seconds,
        "other_cores": timer.other_cores,
        "rank_cpu_s": timer.window.rank_cpu_s,
        "settled": timer.settled,
        "events_before_window": timer.events_before_window,
        "events_in_window": len(history) - timer.events_before_window,
        "final_starts": list(engine.partition.starts),
        "stage_times_s": stage_times,
        "window_checks": [
            {"stage_times": list(d.stage_times), "reason": d.reason, "changed": d.new is not None}
            for d in timer.window_decisions
        ],
        "history": history,
        "all_step_times_s": step_times,
        "first_loss": timer.losses[0],
        "last_loss": timer.losses[-1],
        "losses": timer.losses[:8],
    }


def split_to_counts(split: str, blocks: int) -> list[int]:
    """``"0,4"`` (first block of every stage) -> ``[4, 12]`` (clusters per stage; a block is a cluster)."""
    starts = [int(s) for s in split.split(",")]
    return [b - a for a, b in zip(starts, starts[1:] + [blocks])]


def gather_stage_times(engine: Any) -> list[float] | None:
    """Per stage: sum over its layers of mean forward + mean backward seconds (collective)."""
    layers = engine.local_times()["layers"]
    mine = (engine.stage, sum(f + b for f, b in layers.values()))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return None
    return [t for _, t in sorted(gathered)]


# ---------------------------------------------------------------------- torch.distributed.pipelining
def run_pipelining(args: argparse.Namespace, hiddens: list[int]) -> dict[str, Any] | None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    starts = [int(s) for s in args.split.split(",")]
    if len(starts) != world or starts[0] != 0:
        raise ValueError(f"--split {args.split}: need {world} block indices starting with 0")
    ends = starts[1:] + [len(hiddens)]
    torch.manual_seed(0)
    blocks = build_blocks(args.width, hiddens)  # the whole model, as every contender builds it
    mine = nn.Sequential(*list(blocks)[starts[rank] : ends[rank]])
    del blocks
    stage = PipelineStage(mine, rank, world, torch.device("cpu"))
    schedule_cls = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
    schedule = schedule_cls(stage, args.micro_batches, loss_fn=nn.functional.mse_loss)
    optimizer = torch.optim.SGD(mine.parameters(), lr=args.lr, momentum=0.9)
    data = Batches(args.batch_size, args.width, args.width, length=args.warmup + args.steps + 1)
    window = Window()
    step_starts: list[float] = []
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(args.warmup + args.steps + 1):
        step_starts.append(time.perf_counter())
        if step in (args.warmup, args.warmup + args.steps):
            window.edge()
        if step == args.warmup + args.steps:
            break
        x, y = data[step]
        optimizer.zero_grad()
        micro_losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=micro_losses)
        else:
            schedule.step()
        optimizer.step()
        if micro_losses:
            losses.append(float(torch.stack(micro_losses).mean()))
    fit_s = time.perf_counter() - t0
    other = window.other_cores()
    # the loss lives on the last rank; bring it to rank 0
    payload: list[Any] = [losses]
    dist.broadcast_object_list(payload, src=world - 1)
    losses = payload[0]
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    step_times = [b - a for a, b in zip(step_starts, step_starts[1:])]
    return {
        "fit_s": fit_s,
        "window_start_step": args.warmup,
        "steps": args.steps,
        "window_s": window.seconds,
        "samples_per_s": args.steps * args.batch_size / window.seconds,
        "other_cores": other,
        "rank_cpu_s": window.rank_cpu_s,
        "final_starts": starts,
        "all_step_times_s": step_times,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "losses": losses[:8],
    }


# ---------------------------------------------------------------------- main
def pin_to_core(core: int) -> None:
    """Every thread of this process (and so every thread it starts later) runs on ``core`` only."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {core})


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mode", required=True, choices=("hier", "pipelining"))
    p.add_argument("--rebalance", default="never", help="hier: 'never' or a check interval in steps")
    p.add_argument("--imbalance-threshold", type=float, default=0.1)
    p.add_argument(
        "--split", default="", help="first block of every stage, e.g. 0,8 (hier: default the uniform split)"
    )
    p.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--heavy-blocks", type=int, default=8)
    p.add_argument("--width", type=int, default=256, help="what every block takes and returns")
    p.add_argument("--heavy-hidden", type=int, default=1024)
    p.add_argument("--light-hidden", default="32,16")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--max-settle-steps", type=int, default=60)
    p.add_argument(
        "--pin", action="store_true", help="pin the process (all its threads) to core LOCAL_RANK % cores"
    )
    p.add_argument("--out", type=Path, required=True, help="JSON result (written by rank 0)")
    p.add_argument("--pid-dir", type=Path, default=None, help="write pid.<rank> here")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    rank = int(os.environ["RANK"])
    if args.pin:
        pin_to_core(int(os.environ["LOCAL_RANK"]) % (os.cpu_count() or 1))
    if args.pid_dir is not None:
        (args.pid_dir / f"pid.{rank}").write_text(str(os.getpid()))
    hiddens = hidden_widths(
        args.heavy_blocks, args.heavy_hidden, [int(w) for w in args.light_hidden.split(",")], args.blocks
    )
    torch.manual_seed(0)
    result = run_hier(args, hiddens) if args.mode == "hier" else run_pipelining(args, hiddens)
    if result is not None:
        result.update({"mode": args.mode, "world_size": int(os.environ["WORLD_SIZE"]), "hiddens": hiddens})
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
