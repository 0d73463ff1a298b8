"""The most any pipeline of S stages can reach against one process, measured without a pipeline.

A pipeline of S stages runs each micro-batch's forward and backward once, spread over S cores, and fills
and drains: with perfectly even stages and free messages its step is ``(M + S - 1) / M`` times the
micro-batched model's compute divided by S. Two things make that compute dearer than one process's step:
micro-batching (M small matrix products cost more than one large one) and S busy cores sharing caches,
memory bandwidth and clock. This measures both with plain torch loops (the benchmark's blocks, SGD with
momentum, one thread per process, each pinned to its own core), ``--rounds`` times, interleaved:

- ``whole``: one process, one batch per step (the reference of the pipeline's target ">= 1.4x one process");
- ``micro``: one process, the batch in M micro-batches accumulated;
- ``micro_busy``: the same loop in S processes at once (the cost per core while every core works);

and prints ``bound = whole / ((M + S - 1) / M x micro_busy / S)``: no split, schedule or engine beats it
(nor does a zero-bubble schedule on a 2-core CPU: bench_pipeline_schedules.py).

Two more runs split the blocks into ``--split`` stages (one process each) to show what messages cost:

- ``stages_busy``: every stage's own blocks in a plain loop, all stages at once, no messages;
- ``bare_1f1b``: the same stages exchanging activations and gradients over gloo in 1F1B order, a loop of
  a few lines with no Lightning, no engine and no timing of its own: the fastest a pipeline on this split
  can be here, and the reference for ``bench_pipeline.py``'s contenders.

Each prints its step and every stage's forward + backward per micro-batch; ``bare_1f1b / stages_busy`` of
the latter is what waiting for messages does to the same computation on the machine it runs on::

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
--split          str   auto  blocks per stage of the split runs (auto: bench_pipeline.py's rebalanced one)
--json-out       path  None  write the results as JSON here (default: benchmarks/results/pipeline_bound.json)
"""
TARGET = 1.4
DEFAULT_SPLITS = {"narrow-first": [12, 4], "heavy-first": [5, 11]}
SPLIT_KINDS = {"stages_busy": False, "bare_1f1b": True}  # run: exchanges messages


def _blocks_of(model: str) -> list[int]:
    import _pipeline_worker as blocks

    return blocks.MODELS[model]


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


def _stage(
    model: str,
    batch: int,
    micro: int,
    steps: int,
    split: list[int],
    rank: int,
    piped: bool,
    port: int,
    out: Any,
) -> None:
    """Stage ``rank`` of ``split``: its blocks' forward and backward of ``micro`` micro-batches per step, in
    1F1B order exchanging activations and gradients over gloo (``piped``) or alone on random stand-ins."""
    import _pipeline_worker as blocks
    import torch
    import torch.distributed as dist
    from torch import nn

    stages = len(split)
    os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if piped:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=stages)
    hiddens = blocks.MODELS[model]
    first = sum(split[:rank])
    net = nn.Sequential(*[blocks.Block(blocks.WIDTH, h, torch.tanh) for h in hiddens])[
        first : first + split[rank]
    ]
    optimizer = torch.optim.SGD(net.parameters(), **blocks.SGD)
    rows = batch // micro
    inputs, targets = (
        torch.randn(batch, blocks.WIDTH).chunk(micro),
        torch.randn(batch, blocks.WIDTH).chunk(micro),
    )
    is_first, is_last = rank == 0, rank == stages - 1
    warmup = min(stages - rank - 1, micro)  # 1F1B: forwards before the first backward
    order = "F" * warmup + "FB" * (micro - warmup) + "B" * warmup
    compute = 0.0

    def timed(fn: Any, *a: Any) -> Any:
        nonlocal compute
        start = time.perf_counter()
        result = fn(*a)
        compute += time.perf_counter() - start
        return result

    def receive(source: int) -> torch.Tensor:
        value = torch.empty(rows, blocks.WIDTH)
        if piped:
            dist.recv(value, source)
        else:
            value.normal_()
        return value

    times, computes = [], []
    for _ in range(steps + 3):
        start, compute = time.perf_counter(), 0.0
        optimizer.zero_grad()
        sends, in_flight, forwards = [], [], 0
        for op in order:
            if op == "F":
                x = inputs[forwards] if is_first else receive(rank - 1).requires_grad_()
                y = timed(net, x)
                if is_last:
                    y = timed(lambda out, m: nn.functional.mse_loss(out, targets[m]) / micro, y, forwards)
                elif piped:
                    sends.append(dist.isend(y.detach(), rank + 1))
                in_flight.append((x, y))
                forwards += 1
            else:
                x, y = in_flight.pop(0)
                grad = None if is_last else receive(rank + 1)
                timed(torch.autograd.backward, y, grad)
                if piped and not is_first:
                    sends.append(dist.isend(x.grad, rank - 1))
        for work in sends:
            work.wait()
        optimizer.step()
        times.append(time.perf_counter() - start)
        computes.append(compute / micro)
    if piped:
        dist.destroy_process_group()
    out.put((rank, statistics.median(times[3:]), statistics.median(computes[3:])))


def measure_stages(args: Any, split: list[int], piped: bool) -> tuple[float, list[float]]:
    """The first stage's median step [s] and every stage's median forward + backward per micro-batch."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    config = (args.model, args.batch_size, args.micro_batches, args.steps, split)
    runs = [
        context.Process(target=_stage, args=(*config, rank, piped, port, queue)) for rank in range(len(split))
    ]
    for run in runs:
        run.start()
    results = sorted(queue.get(timeout=600) for _ in runs)
    for run in runs:
        run.join()
    return results[0][1], [compute for _, _, compute in results]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
    split = (
        DEFAULT_SPLITS[args.model] if args.split == "auto" else [int(n) for n in cli.comma_list(args.split)]
    )
    num_blocks = len(_blocks_of(args.model))
    if len(split) != stages or sum(split) != num_blocks or min(split) < 1:
        raise SystemExit(
            f"--split must give each of the {stages} stages blocks, {num_blocks} in all: {split}"
        )
    kinds = {"whole": (1, 1), "micro": (micro, 1), "micro_busy": (micro, stages)}
    times: dict[str, list[float]] = {kind: [] for kind in [*kinds, *SPLIT_KINDS]}
    computes: dict[str, list[list[float]]] = {kind: [] for kind in SPLIT_KINDS}
    for round_index in range(args.rounds):
        for kind, (parts, processes) in kinds.items():
            times[kind].append(measure(args, parts, processes))
            print(
                f"  round {round_index + 1} {kind:10s} {times[kind][-1] * 1e3:8.1f} ms per step", flush=True
            )
        for kind, piped in SPLIT_KINDS.items():
            step, per_stage = measure_stages(args, split, piped)
            times[kind].append(step)
            computes[kind].append(per_stage)
            print(
                f"  round {round_index + 1} {kind:10s} {step * 1e3:8.1f} ms per step, forward + backward per "
                f"micro-batch by stage {', '.join(f'{c * 1e3:.2f}' for c in per_stage)} ms",
                flush=True,
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
        for (kind, v), ref in zip(
            times.items(),
            (median["whole"], median["whole"], median["micro"], median["whole"], median["whole"]),
        )
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
    inflation = [
        statistics.median(
            piped[k] / alone[k] for piped, alone in zip(computes["bare_1f1b"], computes["stages_busy"])
        )
        for k in range(len(split))
    ]
    bare = [whole / piped for whole, piped in zip(times["whole"], times["bare_1f1b"])]
    print(
        f"split {' | '.join(map(str, split))}: a bare gloo 1F1B loop gives {statistics.median(bare):.2f}x "
        f"one process ({min(bare):.2f}-{max(bare):.2f}); waiting for messages makes each stage's "
        f"forward + backward {', '.join(f'{x:.2f}' for x in inflation)}x "
        "what it costs with every stage busy and no messages"
    )
    json_out = args.json_out or jobs.RESULTS_DIR / "pipeline_bound.json"
    payload = {
        "config": report.config(args),
        "split": split,
        "step_s": times,
        "compute_per_micro_batch_s": computes,
        "bound": bounds,
        "bare_1f1b_vs_whole": bare,
        "compute_inflation_by_stage": inflation,
    }
    report.write_json(json_out, payload, make_dir=True)
    print(f"wrote {json_out}")


if __name__ == "__main__":
    main()
