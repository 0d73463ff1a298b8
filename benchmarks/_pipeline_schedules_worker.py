"""One job of ``bench_pipeline_schedules.py``: ``... CONFIG_JSON JOB_DIR``; rank 0 writes ``result.json``.

``schedule`` ``single``: one process trains the whole stack (a plain torch loop, one batch per step).
Otherwise torch's own ``PipelineStage``s on 2 processes: ``1f1b`` with one stage per process on
``split`` (2 starts), or two stages per process on ``split`` (4 starts) with ``zbv`` (V-shaped: process
0 holds stages 0 and 3), ``interleaved_1f1b`` or ``interleaved_zb`` (process r holds stages r and r + 2).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _pipeline_worker import HIDDENS, MODELS, SGD, make_batches, skewed_mlp
from harness.worker import setup
from torch import nn
from torch.distributed.pipelining import PipelineStage, schedules

SCHEDULES = {
    "1f1b": schedules.Schedule1F1B,
    "zbv": schedules.ScheduleZBVZeroBubble,
    "interleaved_1f1b": schedules.ScheduleInterleaved1F1B,
    "interleaved_zb": schedules.ScheduleInterleavedZeroBubble,
}


def stage_indices(schedule: str, rank: int, world: int) -> list[int]:
    """Which of the pipeline's stages process ``rank`` holds."""
    if schedule == "1f1b":
        return [rank]
    if schedule == "zbv":
        return [rank, 2 * world - 1 - rank]
    return [rank, rank + world]


def train(c: dict[str, Any]) -> list[float]:
    """The step times (seconds) of ``warmup + steps`` optimizer steps; every rank gets them."""
    blocks = list(skewed_mlp().blocks)
    batches = make_batches(c["batch_size"])
    if c["schedule"] == "single":
        model, run = nn.Sequential(*blocks), None
        parts = [model]
    else:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        os.sched_setaffinity(0, {rank % os.cpu_count()})
        ends = [*c["split"], len(blocks)]
        indices = stage_indices(c["schedule"], rank, world)
        parts = [nn.Sequential(*blocks[ends[i] : ends[i + 1]]) for i in indices]
        stages = [PipelineStage(p, i, len(c["split"]), torch.device("cpu")) for p, i in zip(parts, indices)]
        make, held = SCHEDULES[c["schedule"]], stages[0] if len(stages) == 1 else stages
        run = make(held, c["micro_batches"], loss_fn=nn.functional.mse_loss)
        first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    optimizer = torch.optim.SGD([p for part in parts for p in part.parameters()], **SGD)
    times = []
    for step in range(c["warmup"] + c["steps"]):
        x, y = batches[step % len(batches)]
        start = time.perf_counter()
        optimizer.zero_grad()
        if run is None:
            nn.functional.mse_loss(model(x), y).backward()
        else:
            kwargs = {"target": y, "losses": []} if last else {}
            run.step(x, **kwargs) if first else run.step(**kwargs)
        optimizer.step()
        if run is not None:
            dist.barrier()  # a step ends when every stage has stepped
        times.append(time.perf_counter() - start)
    if run is not None:
        dist.destroy_process_group()
    return times[c["warmup"] :]


def main() -> None:
    c, job_dir = json.loads(sys.argv[1]), Path(sys.argv[2])
    setup()
    HIDDENS[:] = MODELS[c["model"]]
    torch.manual_seed(0)
    times = train(c)
    if int(os.environ.get("RANK", "0")) == 0:
        (job_dir / "result.json").write_text(json.dumps({"step_times_s": times}))


if __name__ == "__main__":
    main()
