"""Run under torchrun (4 processes, 2 virtual nodes x 2): ``BSPEngine`` on plain torch.

``bsp_checks.py OUT`` runs two scenarios and rank 0 writes their results as JSON:

- ``plain``: ``superstep_steps=1, max_staleness=0`` with SGD + momentum; every rank also computes
  what one process would get by averaging all four ranks' gradients each step (the data-parallel
  reference) and reports the largest relative difference of the final parameters.
- ``straggler``: ``superstep_steps=2, max_staleness=1``; rank 3 sleeps after every micro-step so it
  runs at about a third of the others' speed; the workers stop when the first has done its steps.
  Reports the micro-steps each rank computed and the superstep records (micro-steps per worker,
  staleness), so the test can check that nothing was lost and the bound held.
- ``timed``: the same with ``superstep_seconds=0.1, max_staleness=0`` (supersteps by the controller's
  clock; every gradient applied in the superstep right after its model).
- ``fill``: ``superstep_steps=1, max_staleness=0, fill_idle=2, gradient_average="nominal"``, rank 3
  three times slower, plain SGD on ``loss = sum of all parameters`` (every gradient is exactly 1): the
  final parameters must have moved by ``lr x micro-steps applied / 4``, the superstep records tell
  how the micro-steps were spread.
"""

from __future__ import annotations

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
    engine = engine_for(model, BSPSettings(superstep_steps=1, max_staleness=0))
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
    engine = engine_for(model, settings or BSPSettings(superstep_steps=2, max_staleness=1))
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
    settings = BSPSettings(superstep_steps=1, max_staleness=0, fill_idle=2, gradient_average="nominal")
    engine = engine_for(model, settings, momentum=0.0)
    unit_gradients = lambda step: sum(p.sum() for p in model.parameters())  # noqa: E731 - d/dp = 1 everywhere
    counts = run_uneven(engine, unit_gradients, steps, slow_rank, sleep_s)
    records = [r.to_dict() for r in engine.records]
    # every element moved by the same amount: lr x (sum of 1-gradients) / (superstep_steps x world)
    moved = torch.cat([(a - p.detach()).reshape(-1) for a, p in zip(start, model.parameters())])
    engine.close()
    extremes = {"moved_min": moved.min().item(), "moved_max": moved.max().item()}
    return {"computed": counts, "records": records, **extremes}


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    timed = BSPSettings(superstep_steps=None, superstep_seconds=0.1, max_staleness=0)
    results = {"plain": plain(), "straggler": straggler(), "timed": straggler(steps=30, settings=timed)}
    results["fill"] = fill()
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
