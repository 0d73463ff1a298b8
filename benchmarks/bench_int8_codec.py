"""The int8 inter-node codec's host work against a bf16 cast: what ``inter_node_dtype="int8"`` costs the CPU.

One process, no network: ``quantize`` and ``dequantize`` of a slice cut into ``--nodes`` parts, and the
whole hop (``int8_all_reduce`` with error feedback on a one-process gloo group, so the collectives are local
copies and what is timed is the codec's passes over the data; ``collectives`` times those copies alone, on
int8 messages of the hop's sizes). Anchors: a plain bf16 cast of the slice and
the bf16 hop's host work (error feedback, cast, residual). Default size: one rank's slice of
``bench_hier_sliced.py`` (6.3 M parameters over 2 processes per node); ``--piece-mb 1`` cuts it into the
1 MB pieces that hier_sliced's CPU reducer sends one by one.

Every variant runs once per round, interleaved (a loaded machine slows them alike); prints the median over
``--repeats`` rounds of each and its ratio to the bf16 cast::

    python benchmarks/bench_int8_codec.py [--numel 3145728] [--nodes 2] [--repeats 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def _variants(args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    from lightning_hier.sliced.int8_codec import blocks_of, dequantize, int8_all_reduce, quantize

    generator = torch.Generator().manual_seed(0)
    gradient = torch.randn(args.numel, generator=generator)
    part = -(-args.numel // args.nodes)
    rows = torch.nn.functional.pad(gradient, (0, args.nodes * part - args.numel)).view(args.nodes, part)
    q, scales = quantize(rows)
    piece = args.numel if args.piece_mb <= 0 else max(1, int(args.piece_mb * 2**20) // 4)
    bounds = [(lo, min(lo + piece, args.numel)) for lo in range(0, args.numel, piece)]
    out, residual = gradient.clone(), torch.zeros(args.numel)
    group = dist.group.WORLD

    def int8_hop() -> None:
        out.copy_(gradient)
        for lo, hi in bounds:
            work, decode = int8_all_reduce(out[lo:hi], residual[lo:hi], group)
            work.wait()
            decode()

    def bf16_hop() -> None:  # what the reducer does around a bf16 all-reduce (reducer.py)
        out.copy_(gradient)
        for lo, hi in bounds:
            piece_out, piece_residual = out[lo:hi], residual[lo:hi]
            piece_out.add_(piece_residual)
            narrow = piece_out.to(torch.bfloat16)
            torch.sub(piece_out, narrow, out=piece_residual)
            piece_residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
            piece_out.copy_(narrow)

    messages = []  # the hop's two collectives on int8 messages of its sizes: what is not the codec
    for lo, hi in bounds:
        piece_part = -(-(hi - lo) // dist.get_world_size(group))
        width = piece_part + 4 * blocks_of(piece_part)
        shape = (dist.get_world_size(group), width)
        messages.append([torch.zeros(shape, dtype=torch.int8) for _ in range(3)])

    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def collectives() -> None:
        for message, received, gathered in messages:
            dist.all_to_all_single(received, message, group=group)
            all_gather(gathered, message[:1], group=group)

    return {
        "bf16_cast": lambda: gradient.to(torch.bfloat16),
        "quantize": lambda: quantize(rows),
        "dequantize": lambda: dequantize(q, scales),
        "bf16_hop": bf16_hop,
        "int8_hop": int8_hop,
        "collectives": collectives,
    }


def main(argv: list[str] | None = None) -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--numel", type=int, default=3_145_728, help="elements of the slice")
    parser.add_argument("--nodes", type=int, default=2, help="parts (rows) that quantize/dequantize see")
    parser.add_argument("--piece-mb", type=float, default=0.0, help="hop in pieces of this size (0: whole)")
    parser.add_argument("--repeats", type=int, default=30, help="rounds; the median is printed")
    parser.add_argument("--warmup", type=int, default=3, help="rounds not counted")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (a rank's share)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            variants = _variants(args)
            times: dict[str, list[float]] = {name: [] for name in variants}
            for round_ in range(args.warmup + args.repeats):
                for name, run in variants.items():
                    start = time.perf_counter()
                    run()
                    if round_ >= args.warmup:
                        times[name].append(time.perf_counter() - start)
        finally:
            dist.destroy_process_group()
    medians = {name: statistics.median(values) for name, values in times.items()}
    anchor = medians["bf16_cast"]
    print(
        f"{args.numel:,} elements, {args.nodes} parts, "
        + (f"pieces of {args.piece_mb} MB, " if args.piece_mb > 0 else "one piece, ")
        + f"{args.threads} thread(s), median of {args.repeats}"
    )
    for name, value in medians.items():
        print(f"  {name:<11} {value * 1e3:9.2f} ms  {value / anchor:7.2f}x bf16_cast")
    print(f"  int8_hop / bf16_hop: {medians['int8_hop'] / medians['bf16_hop']:.2f}")
    codec = medians["int8_hop"] - medians["collectives"]
    print(f"  int8_hop less collectives: {codec * 1e3:.2f} ms, {codec / medians['bf16_hop']:.2f}x bf16_hop")


if __name__ == "__main__":
    main()
