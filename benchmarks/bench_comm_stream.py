"""hier_sliced's reduction on a side stream against the same reduction waited for on the compute stream.

On CUDA the reducer issues each bucket's reduce-scatter and all-reduce on a communication stream of its
own, and the compute stream waits for it once, before the optimizer. The reference waits inside each
gradient hook on the compute stream (``work.wait()`` with the compute stream current), which holds every
later backward kernel behind that bucket's reduce-scatter. One CUDA device, NCCL with world size 1 and
``LIGHTNING_HIER_FORCE_COLLECTIVES=1``, so every collective of a multi-rank step runs on a one-rank
communicator; ``no_comm`` (the collectives skipped) is the floor.

Measured per step with CUDA events: backward plus ``finish_backward`` (the compute stream's wait included),
the modes interleaved over ``--rounds``; prints the medians and each mode's ratio to ``compute_stream``::

    python benchmarks/bench_comm_stream.py [--layers 24] [--hidden 4096] [--batch-size 64] [--bucket-mb 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

MODES = ("side_stream", "compute_stream", "no_comm")


def _engine(mode: str, args: argparse.Namespace) -> tuple:
    from lightning_hier import HierSlicedEngine, Topology
    from lightning_hier.single_rank import FORCE_COLLECTIVES_ENV
    from lightning_hier.sliced.comm_stream import HostStream

    os.environ[FORCE_COLLECTIVES_ENV] = "0" if mode == "no_comm" else "1"
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.hidden, args.hidden) for _ in range(args.layers)]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.ReLU())]).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    engine = HierSlicedEngine(
        model, optimizer, Topology(1, 0, 1).build_groups(), bucket_cap_mb=args.bucket_mb, reducer="inline"
    )
    if mode == "compute_stream":  # the reference: every wait on the stream the hooks run on
        engine._reducer.stream = HostStream()
    return model, optimizer, engine


def _time_backward(mode: str, args: argparse.Namespace) -> list[float]:
    model, optimizer, engine = _engine(mode, args)
    data = torch.randn(args.batch_size, args.hidden, device="cuda")
    times = []
    for step in range(args.warmup + args.steps):
        optimizer.zero_grad()
        loss = model(data).square().mean()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        engine.begin_backward()
        loss.backward()
        engine.finish_backward()
        end.record()
        optimizer.step()
        engine.after_step()
        if step >= args.warmup:
            end.synchronize()
            times.append(start.elapsed_time(end))
    engine.close()
    return times


def main(argv: list[str] | None = None) -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_comm_stream.py needs a CUDA device (it measures stream overlap).")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    torch.cuda.set_device(0)
    dist.init_process_group("cuda:nccl,cpu:gloo", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        per_mode: dict[str, list[float]] = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                per_mode[mode].append(statistics.median(_time_backward(mode, args)))
    finally:
        dist.destroy_process_group()
    reference = statistics.median(per_mode["compute_stream"])
    print(f"device: {torch.cuda.get_device_name(0)}; {args.layers} x Linear({args.hidden}, {args.hidden}), "
          f"batch {args.batch_size}, buckets of {args.bucket_mb} MB, {args.steps} steps x {args.rounds} "
          "rounds")
    print(f"{'mode':<16}{'backward + finish [ms]':>24}{'per round':>28}{'/ compute_stream':>18}")
    for mode, medians in per_mode.items():
        median = statistics.median(medians)
        rounds = ", ".join(f"{m:.2f}" for m in medians)
        print(f"{mode:<16}{median:>24.2f}{rounds:>28}{median / reference:>18.3f}")


if __name__ == "__main__":
    main()
