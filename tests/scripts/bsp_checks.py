"""Run under torchrun (4 processes, 2 virtual nodes x 2): ``BSPEngine`` on plain torch.

``bsp_checks.py OUT`` runs two scenarios and rank 0 writes their results as JSON:

- ``plain``: ``superstep=1, max_staleness=0`` with SGD + momentum; every rank also computes
  what one process would get by averaging all four ranks' gradients each step (the data-parallel
  reference) and reports the largest relative difference of the final parameters.
- ``straggler``: ``superstep=2, max_staleness=1``; rank 3 sleeps after every micro-step so it
  runs at about a third of the others' speed; the workers stop when the first has done its steps.
  Reports the micro-steps each rank computed and the superstep records (micro-steps per worker,
  staleness), so the test can check that nothing was lost and the bound held.
- ``timed``: the same with ``superstep="0.1s", max_staleness=0`` (supersteps by the controller's
  clock; every gradient applied in the superstep right after its model).
- ``fill``: ``superstep=1, max_staleness=0, fill_idle=2, gradient_average="nominal"``, rank 3
  three times slower, plain SGD on ``loss = sum of all parameters`` (every gradient is exactly 1): the
  final parameters must have moved by ``lr x micro-steps applied / 4``, the superstep records tell
  how the micro-steps were spread.
- ``handoff_plain`` / ``handoff_straggler`` / ``handoff_broken``: the CUDA stream protocol checked on
  the CPU. :class:`CheckingHandoff` stands in for ``StreamHandoff`` and records, for every access the
  worker and the local BSP module share (a fold and the push that reads it, an announce and the pick-up
  that copies it, the zeroing of pushed sums, a task), whether the reader took over after the writer
  handed over (what the events guarantee on a GPU, where the two threads queue on different streams).
  ``handoff_broken`` drops the module's take-overs: the checker must find the accesses it no longer
  orders.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from lightning_hier.bsp.engine import BSPEngine
from lightning_hier.bsp.settings import BSPSettings
from lightning_hier.topology import Topology

FEATURES, HIDDEN, BATCH = 8, 16, 8


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(BATCH, FEATURES, generator=generator), torch.randn(BATCH, 1, generator=generator)


def loss_of(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = data
    return nn.functional.mse_loss(model(x), y)


def engine_for(model: nn.Module, settings: BSPSettings, momentum: float = 0.9) -> BSPEngine:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    topology = Topology.from_world(dist.get_world_size(), dist.get_rank(), 2, 2).build_groups(
        timedelta(seconds=60), dedicated=True
    )
    return BSPEngine(model, optimizer, topology, settings, bucket_cap_mb=0.0005, timeout_s=60)


def plain(steps: int = 6) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    engine = engine_for(model, BSPSettings(superstep=1, max_staleness=0))
    for step in range(steps):
        engine.begin_step()
        engine.zero_grad()
        loss_of(model, batch(rank, step)).backward()
        engine.end_step()
    engine.drain()
    reference = make_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        optimizer.zero_grad()
        grads = []
        for worker in range(world):
            reference.zero_grad()
            loss_of(reference, batch(worker, step)).backward()
            grads.append([p.grad.clone() for p in reference.parameters()])
        for i, p in enumerate(reference.parameters()):
            p.grad = sum(g[i] for g in grads) / world
        optimizer.step()
    diff = max(
        ((a - b).abs().max() / b.abs().max()).item()
        for a, b in zip(model.parameters(), reference.parameters())
    )
    moved = max(
        ((a - b).abs().max() / b.abs().max()).item()
        for a, b in zip(make_model().parameters(), reference.parameters())
    )
    supersteps = len(engine.records)
    engine.close()
    return {"max_rel_diff": diff, "reference_moved": moved, "supersteps": supersteps}


def run_uneven(
    engine: BSPEngine, loss: Callable[[int], torch.Tensor], steps: int, slow_rank: int, sleep_s: float
) -> list[int]:
    """Micro-steps of ``loss(step)`` with a sleep after each backward, three times as long on
    ``slow_rank``, until the first worker has done ``steps``; then a drain. The steps of every rank."""
    computed = 0
    for step in range(steps):
        if engine.epoch_should_end:
            break
        engine.begin_step()
        engine.zero_grad()
        loss(step).backward()
        time.sleep(sleep_s * (3 if dist.get_rank() == slow_rank else 1))
        engine.end_step()
        computed += 1
    engine.drain(epoch_end=True)
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, computed)
    return counts


def straggler(
    steps: int = 24, slow_rank: int = 3, sleep_s: float = 0.03, settings: BSPSettings | None = None
) -> dict:
    rank = dist.get_rank()
    model = make_model()
    engine = engine_for(model, settings or BSPSettings(superstep=2, max_staleness=1))
    counts = run_uneven(engine, lambda step: loss_of(model, batch(rank, step)), steps, slow_rank, sleep_s)
    records = [r.to_dict() for r in engine.records]
    state = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    states = [torch.empty_like(state) for _ in range(dist.get_world_size())]
    dist.all_gather(states, state)
    engine.close()
    return {
        "computed": counts,
        "records": records,
        "same_model_everywhere": all(torch.equal(s, states[0]) for s in states),
    }


def fill(steps: int = 24, slow_rank: int = 3, sleep_s: float = 0.03) -> dict:
    model = make_model()
    start = [p.detach().clone() for p in model.parameters()]
    settings = BSPSettings(superstep=1, max_staleness=0, fill_idle=2, gradient_average="nominal")
    engine = engine_for(model, settings, momentum=0.0)
    unit_gradients = lambda step: sum(p.sum() for p in model.parameters())  # noqa: E731 - d/dp = 1 everywhere
    counts = run_uneven(engine, unit_gradients, steps, slow_rank, sleep_s)
    records = [r.to_dict() for r in engine.records]
    # every element moved by the same amount: lr x (sum of 1-gradients) / (superstep x world)
    moved = torch.cat([(a - p.detach()).reshape(-1) for a, p in zip(start, model.parameters())])
    engine.close()
    extremes = {"moved_min": moved.min().item(), "moved_max": moved.max().item()}
    return {"computed": counts, "records": records, **extremes}


class CheckingHandoff:
    """``StreamHandoff``'s interface with counters instead of events: each hand-over numbers what its
    side wrote so far, each take-over remembers the newest number it waited for. An access by one side
    to what the other wrote is ordered if that side took over a hand-over made after the write."""

    def __init__(self, engine: BSPEngine, module_takes_over: bool = True) -> None:
        self.to_module = self.to_worker = 0  # hand-overs made by the worker / by the module
        self.module_seen = self.worker_seen = 0  # the newest of the other side's hand-overs waited for
        self.module_takes = module_takes_over
        self.unordered: list[str] = []
        self.accesses: dict[str, int] = {}
        self._fold_needs: dict[int, int] = {}  # per sums buffer: the hand-over that covers its last fold
        self._announce_needs = 0
        self._pickup_needs = 0
        self._pushed_unsynced = False
        memory, aggregate = engine.memory, engine.memory.aggregate
        self._wrap(aggregate, "fold", after=self._folded_all)
        self._wrap(aggregate, "fold_bucket", after=self._folded_one)
        self._wrap(aggregate, "recycle", before=self._recycling)
        self._wrap(engine.server, "push", before=self._pushing)
        self._wrap(memory, "announce", after=self._announced)
        self._wrap(engine, "_pick_up", before=self._picking_up, after=self._picked_up)
        self._wrap_call(engine.module)
        self._aggregate = aggregate
        self._memory = memory
        memory.handoff = self

    # -- StreamHandoff's interface
    @contextlib.contextmanager
    def module_stream(self):  # noqa: ANN201
        yield

    def worker_hands_over(self) -> None:
        self.to_module += 1

    def module_takes_over(self) -> None:
        if self.module_takes:
            self.module_seen = self.to_module

    def module_hands_over(self) -> None:
        self.to_worker += 1

    def worker_takes_over(self) -> None:
        self.worker_seen = self.to_worker

    def worker_takes_result(self, result: object) -> object:
        self.worker_takes_over()
        return result

    def module_synchronize(self) -> None:
        self._pushed_unsynced = False

    # -- the accesses
    def _wrap(self, owner: object, name: str, before=None, after=None) -> None:  # noqa: ANN001
        original = getattr(owner, name)

        @functools.wraps(original)
        def checked(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.accesses[name] = self.accesses.get(name, 0) + 1
            if before is not None:
                before(*args, **kwargs)
            result = original(*args, **kwargs)
            if after is not None:
                after(*args, **kwargs)
            return result

        setattr(owner, name, checked)

    def _wrap_call(self, module) -> None:  # noqa: ANN001
        """A task run on the module's thread must see what the worker wrote; its result, what it made."""
        original = module.call

        def call(task):  # noqa: ANN001, ANN202
            self.accesses["call"] = self.accesses.get("call", 0) + 1
            needs = self.to_module + 1  # call() hands over before it queues the task

            def checked_task():  # noqa: ANN202
                if self.module_seen < needs:
                    self.unordered.append("task ran before the worker's hand-over")
                return task()

            result = original(checked_task)
            if self.worker_seen < self.to_worker:
                self.unordered.append("task result used before the module handed it over")
            return result

        module.call = call

    def _folded_one(self, index: int, grad: torch.Tensor) -> None:
        self._fold_needs[self._aggregate.sums[index].data_ptr()] = self.to_module + 1

    def _folded_all(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        for total in self._aggregate.sums:
            self._fold_needs[total.data_ptr()] = self.to_module + 1

    def _pushing(self, sums, buckets=None) -> None:  # noqa: ANN001
        for b in range(len(sums)) if buckets is None else buckets:
            if self.module_seen < self._fold_needs.get(sums[b].data_ptr(), 0):
                self.unordered.append(f"push of bucket {b} before its fold was handed over")
        self._pushed_unsynced = True

    def _recycling(self, out) -> None:  # noqa: ANN001
        if self._pushed_unsynced:
            self.unordered.append("pushed sums zeroed before the module's stream finished the push")

    def _announced(self, flat_params) -> None:  # noqa: ANN001
        if self.module_seen < self._pickup_needs:
            self.unordered.append("published model overwritten before the worker's copy was handed over")
        self._announce_needs = self.to_worker  # handed over inside announce, after the copy

    def _picking_up(self) -> None:
        self._will_copy = self._memory.picked_up != self._memory.version

    def _picked_up(self) -> None:
        if self._will_copy:
            if self.worker_seen < self._announce_needs or self._announce_needs == 0:
                self.unordered.append("published model copied before its announce was handed over")
            self._pickup_needs = self.to_module  # handed over inside _pick_up, after the copy


def handoff(settings: BSPSettings, early_push: bool, module_takes_over: bool = True, steps: int = 12) -> dict:
    """Micro-steps (every rank's last backward announced, so plain BSP pushes early) under the checker."""
    rank = dist.get_rank()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    topology = Topology.from_world(dist.get_world_size(), rank, 2, 2).build_groups(
        timedelta(seconds=60), dedicated=True
    )
    engine = BSPEngine(
        model, optimizer, topology, settings, bucket_cap_mb=0.0002, timeout_s=60, early_push=early_push
    )
    checker = CheckingHandoff(engine, module_takes_over)
    for step in range(steps):
        engine.begin_step()
        engine.zero_grad()
        engine.expect_last_backward()
        loss_of(model, batch(rank, step)).backward()
        if rank == 3:
            time.sleep(0.01)
        engine.end_step()
    engine.drain()
    state = engine.optimizer_state_dict()  # a task on the module's thread
    engine.close()
    early = sum(r.early_buckets + r.ready_buckets for r in engine.records)
    return {
        "unordered": sorted(set(checker.unordered)),
        "accesses": checker.accesses,
        "early_or_ready_buckets": early,
        "state_entries": len(state["state"]),
    }


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    timed = BSPSettings(superstep="0.1s", max_staleness=0)
    results = {"plain": plain(), "straggler": straggler(), "timed": straggler(steps=30, settings=timed)}
    results["fill"] = fill()
    plain_bsp = BSPSettings(superstep=1, max_staleness=0)
    results["handoff_plain"] = handoff(plain_bsp, early_push=True)
    results["handoff_straggler"] = handoff(BSPSettings(superstep=2, max_staleness=1), early_push=False)
    results["handoff_broken"] = handoff(plain_bsp, early_push=True, module_takes_over=False)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
