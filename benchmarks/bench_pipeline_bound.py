"""The most any pipeline of S stages can reach against one process, measured without a pipeline.

A pipeline of S stages runs each micro-batch's forward and backward once, spread over S cores, and fills
and drains: with perfectly even stages and free messages its step is ``(M + S - 1) / M`` times the
micro-batched model's compute divided by S. Two things make that compute dearer than one process's step:
micro-batching (M small matrix products cost more than one large one) and S busy cores sharing caches,
memory bandwidth and clock. This measures both with plain torch loops (the benchmark's blocks, SGD with
momentum, one thread per process, each pinned to its own core), ``--rounds`` times, interleaved:

- ``whole``: one process, one batch per step (the reference of issue 14's ">= 1.4x one process");
- ``micro``: one process, the batch in M micro-batches accumulated;
- ``micro_busy``: the same loop in S processes at once (the cost per core while every core works);

and prints ``bound = whole / ((M + S - 1) / M x micro_busy / S)``: no split, schedule or engine beats it
(a zero-bubble schedule does not either on this host: bench_pipeline_schedules.py)::

    python benchmarks/bench_pipeline_bound.py [--model narrow-first] [--batch-size 512] [--micro-batches 4]
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from typing import Any

from harness import cli, jobs, report

OPTIONS = """
--model {heavy-first,narrow-first} narrow-first  the blocks' widths (as bench_pipeline.py)
--batch-size     int   512   samples per step
--micro-batches  int   4     micro-batches per step
--stages         int   2     processes of the busy run (one per core)
--steps          int   40    measured steps per run (after 3 more)
--rounds         int   3     runs of each, interleaved
--json-out       path  None  write the results as JSON here (default: benchmarks/results/pipeline_bound.json)
"""
TARGET = 1.4


def _train(model: str, batch: int, micro: int, steps: int, core: int, out: Any) -> None:
    """One process: ``steps`` SGD steps over ``batch`` samples in ``micro`` parts; the median step time."""
    import _pipeline_worker as blocks
    import torch
    from torch import nn

    os.sched_setaffinity(0, {core % (os.cpu_count() or 1)})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = nn.Sequential(*[blocks.Block(blocks.WIDTH, h, torch.tanh) for h in blocks.MODELS[model]])
    optimizer = torch.optim.SGD(net.parameters(), **blocks.SGD)
    inputs, targets = torch.randn(batch, blocks.WIDTH), torch.randn(batch, blocks.WIDTH)
    parts = list(zip(inputs.chunk(micro), targets.chunk(micro)))
    times = []
    for _ in range(steps + 3):
        start = time.perf_counter()
        optimizer.zero_grad()
        for x, y in parts:
            (nn.functional.mse_loss(net(x), y) / micro).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    out.put(statistics.median(times[3:]))


def measure(args: Any, micro: int, processes: int) -> float:
    """Mean over ``processes`` simultaneous runs of their median step time [s]."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    config = (args.model, args.batch_size, micro, args.steps)
    runs = [context.Process(target=_train, args=(*config, core, queue)) for core in range(processes)]
    for run in runs:
        run.start()
    results = [queue.get(timeout=600) for _ in runs]
    for run in runs:
        run.join()
    return statistics.fmean(results)


def main(argv: list[str] | None = None) -> None:
    args = cli.parser(__doc__, OPTIONS).parse_args(argv)
    if args.batch_size % args.micro_batches:
        raise SystemExit(f"--batch-size {args.batch_size} must divide into {args.micro_batches} parts")
    micro, stages = args.micro_batches, args.stages
    kinds = {"whole": (1, 1), "micro": (micro, 1), "micro_busy": (micro, stages)}
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for round_index in range(args.rounds):
        for kind, (parts, processes) in kinds.items():
            times[kind].append(measure(args, parts, processes))
            print(
                f"  round {round_index + 1} {kind:10s} {times[kind][-1] * 1e3:8.1f} ms per step", flush=True
            )
    bounds = [
        whole / ((micro + stages - 1) / micro * busy / stages)
        for whole, busy in zip(times["whole"], times["micro_busy"])
    ]
    median = {kind: statistics.median(values) for kind, values in times.items()}
    rows = [
        [
            kind,
            f"{median[kind] * 1e3:.1f}",
            f"{min(v) * 1e3:.1f}-{max(v) * 1e3:.1f}",
            f"{median[kind] / ref:.2f}",
        ]
        for (kind, v), ref in zip(times.items(), (median["whole"], median["whole"], median["micro"]))
    ]
    print(
        f"{args.model}, batch {args.batch_size} in {micro} micro-batches, "
        f"{stages} stages on {os.cpu_count()} cores"
    )
    print(
        report.md_table(["run", "ms per step (median)", "range", "against the row's reference"], rows, False)
    )
    verdict = "possible" if statistics.median(bounds) >= TARGET else "NOT possible"
    print(
        f"bound for any {stages}-stage pipeline with perfectly even stages and free messages: "
        f"{statistics.median(bounds):.2f}x one process ({min(bounds):.2f}-{max(bounds):.2f}); "
        f"{TARGET}x {verdict} here"
    )
    json_out = args.json_out or jobs.RESULTS_DIR / "pipeline_bound.json"
    payload = {"config": report.config(args), "step_s": times, "bound": bounds}
    report.write_json(json_out, payload, make_dir=True)
    print(f"wrote {json_out}")


if __name__ == "__main__":
    main()
