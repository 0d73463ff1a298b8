"""One stage process of ``bench_pipeline.py`` (launched P times by ``torch.distributed.run``).

Every mode trains the same seeded model on the same data: 16 residual MLP blocks :class:`Block`
(width 256), the first 8 heavy (hidden 1024), the rest light (32, then 16); MSE, SGD (lr 0.01,
momentum 0.9), ``--micro-batches`` micro-batches of ``--batch-size``, 4 batches cycled, one thread
(``--pin``: on core ``LOCAL_RANK mod cores``), gloo. ``hier``: Lightning with
``HierPipelineStrategy(partition="uniform", rebalance=never|N)`` (the skip connection makes every block
one cluster; checked). ``pipelining``: ``torch.distributed.pipelining.PipelineStage`` built by hand
from ``--split`` with ``Schedule1F1B`` / ``ScheduleGPipe``. Rank 0 times a window of ``--steps`` steps,
start to start, barriers at both edges: after ``--warmup`` steps, or (rebalanced) from the first step
after a check that left the split unchanged (or after ``--max-settle-steps``, flagged), its length
rounded up to whole check intervals. Stage times (per micro-batch, the sum over the stage's layers of
mean forward + backward seconds) come from the window's checks (rebalanced) or from every stage's layer
times since the window's start (uniform); other processes' CPU use is host busy time minus the workers'.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from harness import cli
from harness.jobs import host_busy_seconds
from torch import nn
from torch.utils.data import DataLoader, Dataset

NUM_DATA_BATCHES = 4  # distinct pre-generated batches, cycled
OPTIONS = """
--mode                {hier,pipelining}  required
--rebalance           str    never      hier: 'never' or a check interval in steps
--imbalance-threshold float  0.1
--split               str    ""         first block of every stage, e.g. 0,8 (hier: default the uniform split)
--schedule            {1f1b,gpipe}  1f1b
--blocks              int    16
--heavy-blocks        int    8
--width               int    256        what every block takes and returns
--heavy-hidden        int    1024
--light-hidden        str    32,16
--batch-size          int    512
--micro-batches       int    8
--lr                  float  0.01
--warmup              int    8
--steps               int    30
--max-settle-steps    int    60
--pin                 flag   -          pin the process (all its threads) to core LOCAL_RANK %% cores
--out                 path   required   JSON result (written by rank 0)
--pid-dir             path   None       write pid.<rank> here
"""


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
    from harness.worker import quiet_trainer
    from lightning.pytorch import Callback

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
    trainer = quiet_trainer(
        devices=world,
        strategy=strategy,
        max_steps=args.max_settle_steps + steps + args.warmup + 10,
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


def main() -> None:
    """Pin, write the pid, train in the chosen mode; rank 0 writes the result."""
    args = cli.parser(__doc__, OPTIONS).parse_args()
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
