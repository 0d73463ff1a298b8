"""Run under torchrun (2 or 4 processes): the 1F1B and GPipe schedules on plain torch, recorded.

``schedule_pairing.py OUT`` builds one ``Linear`` + ``tanh`` per stage, runs one training step for
several micro-batch counts under both schedules while ``CollectiveAudit`` records every
operation, and compares each stage's gradients with one process computing the whole model on the
whole batch. Rank 0 writes a JSON summary; every rank writes its audit record.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_hier.audit import CollectiveAudit, start_from_env
from lightning_hier.pipeline.engine import rank_of_stage
from lightning_hier.pipeline.schedule import PipelineSchedule, StageLink
from lightning_hier.topology import control_group, resolve_backend

WIDTH, BATCH = 8, 12
# per stage count: the extra warm-up forwards tried (the last stage's entry is not used)
EXTRA_WARMUPS = {2: [(1,), (3,)], 4: [(1, 0, 0), (0, 2, 0), (0, 0, 1), (2, 1, 1)]}


def model(stages: int) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(stages))


def reference_grads(stages: int, x: torch.Tensor) -> list[torch.Tensor]:
    layers = model(stages)
    h = x
    for layer in layers:
        h = torch.tanh(layer(h))
    h.pow(2).mean().backward()
    return [layer.weight.grad.clone() for layer in layers]


def run(
    schedule: str,
    num_micro: int,
    stage: int,
    stages: int,
    group: dist.ProcessGroup,
    static: bool = False,
    extra_warmup: tuple[int, ...] = (),
) -> dict:
    layer = model(stages)[stage]
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))
    micro = list(torch.tensor_split(x, num_micro))
    keys = [len(m) for m in micro] if static else None  # static_shapes: a header per new row count
    link = StageLink(stage, stages, lambda s: rank_of_stage(stages, s), torch.device("cpu"), group)

    def forward(m: int, received: torch.Tensor | None) -> torch.Tensor:
        h = torch.tanh(layer(micro[m] if received is None else received))
        if stage == stages - 1:
            return h.pow(2).mean() * (len(micro[m]) / BATCH)
        return h

    pipeline = PipelineSchedule(link, schedule)
    pipeline.extra_warmup = list(extra_warmup)
    pipeline.train_step(num_micro, forward, keys)
    expected = reference_grads(stages, x)[stage]
    return {
        "max_diff": (layer.weight.grad - expected).abs().max().item(),
        "held_sends_after_step": len(link._lone_sends),
        "receives_pending_after_step": link.receives_pending,
        "activations_posted_ahead": link.activations_posted_ahead,
        "headers_received": link.headers_received,
        "headers_sent": link.headers_sent,
        "peak_in_flight": pipeline.peak_in_flight,
        "in_flight_limit": pipeline.in_flight_limit(num_micro),
    }


def main() -> None:
    out = Path(sys.argv[1])
    start_from_env()  # the emulated backend: this group is made here, not by a strategy's setup
    dist.init_process_group(resolve_backend(torch.device("cpu")))
    rank, stages = dist.get_rank(), dist.get_world_size()
    stage = stages - 1 - rank
    group = control_group()
    results = {}
    with CollectiveAudit() as audit:
        for schedule in ("1f1b", "gpipe"):
            for num_micro in (1, stages - 1 or 1, stages + 2):
                results[f"{schedule}/{num_micro}"] = run(schedule, num_micro, stage, stages, group)
            # 12 rows in 5 micro-batches: 3, 3, 2, 2, 2 rows, so two headers cross each cut
            results[f"{schedule}/5/static"] = run(schedule, 5, stage, stages, group, static=True)
        # extra warm-up forwards (pipeline/warmup.py): the stages before each extra one run ahead
        for extra in EXTRA_WARMUPS[stages]:
            name = ",".join(map(str, extra))
            results[f"extra/{stages + 2}/{name}"] = run(
                "1f1b", stages + 2, stage, stages, group, False, extra
            )
            results[f"extra/5/{name}/static"] = run("1f1b", 5, stage, stages, group, True, extra)
    audit.dump(out.parent / "audit")
    gathered = [None] * stages
    dist.all_gather_object(gathered, results, group=group)
    if rank == 0:
        out.write_text(json.dumps(gathered))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
