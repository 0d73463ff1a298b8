"""``python -m lightning_hier plan ...``: the cost model's table for one cluster and model."""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence

from lightning_hier.plan.calibrate import calibrate_from_csv
from lightning_hier.plan.cost_model import DTYPE_BYTES, Cluster, Plan, plan

_RATE_UNITS = {
    "": 1.0, "b/s": 1.0, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "tb/s": 1e12,
    "bit/s": 1 / 8, "kbit/s": 1e3 / 8, "mbit/s": 1e6 / 8, "gbit/s": 1e9 / 8, "tbit/s": 1e12 / 8,
}  # fmt: skip
_TIME_UNITS = {"": 1e-6, "s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def rate(text: str) -> float:
    """``"400Gbit/s"``, ``"400Gbit"``, ``"50GB/s"`` or a plain number of bytes/s -> bytes/s."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z/]*)\s*", text)
    unit = (match.group(2) if match else "").lower()
    unit = unit if unit.endswith("/s") or unit == "" else unit + "/s"
    if not match or unit not in _RATE_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate such as 400Gbit/s, 50GB/s or 2e9")
    return float(match.group(1)) * _RATE_UNITS[unit]


def duration(text: str) -> float:
    """``"5us"``, ``"2ms"``, ``"0.1s"``; a plain number is microseconds."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-z]*)\s*", text)
    if not match or match.group(2) not in _TIME_UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 5us, 2ms or 0.1s")
    return float(match.group(1)) * _TIME_UNITS[match.group(2)]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lightning_hier plan",
        description="Predicted communication per step of ddp (flat ring), hier_sliced (equal and weighted "
        "slices, with and without overlapping backward, with a compressed inter-node hop), hier_bsp (per "
        "superstep), hier_pipeline (stages x replicas) and the bandwidth bound.",
    )
    p.add_argument("--nodes", type=int, default=None)
    p.add_argument("--world-size", type=int, default=None, help="instead of --nodes: nodes = world / devices")
    p.add_argument("--devices-per-node", type=int, required=True)
    p.add_argument("--intra-bandwidth", type=rate, required=True, help="per device, e.g. 300GB/s (NVLink)")
    p.add_argument("--inter-bandwidth", type=rate, required=True, help="per node, e.g. 400Gbit/s")
    p.add_argument("--latency", type=duration, default=5e-6, help="per message step, e.g. 5us (default)")
    p.add_argument("--params", type=float, required=True, help="parameters to synchronise, e.g. 7e9")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="fp32", help="gradient dtype")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--backward", type=duration, default=None, help="backward time per step, e.g. 120ms")
    p.add_argument("--slice-weights", type=float, nargs="+", default=None)
    p.add_argument("--superstep-steps", type=int, default=4)
    p.add_argument(
        "--inter-node-dtype", choices=["bfloat16", "int8", "fp8"], default=None,
        help="adds hier_sliced and hier_bsp with this compressed inter-node hop",
    )  # fmt: skip
    p.add_argument(
        "--pipeline-stages", type=int, nargs="+", default=[], metavar="S",
        help="adds a hier_pipeline row per number of stages (each must divide the world size)",
    )  # fmt: skip
    p.add_argument("--micro-batches", type=int, default=4, help="hier_pipeline: micro-batches per step")
    p.add_argument(
        "--activation-mb", type=float, default=None,
        help="hier_pipeline: one micro-batch's activation at a stage boundary, in MiB",
    )  # fmt: skip
    p.add_argument(
        "--step-compute", type=duration, default=None,
        help="forward + backward per device and step under ddp (default: 1.5x --backward)",
    )  # fmt: skip
    p.add_argument(
        "--calibrate-from", nargs="+", default=None, metavar="CSV",
        help="CommProfiler comm_profile.csv of a measured run (one or more of one layout): the fitted "
        "intra/inter bandwidth and latency replace the values above (what cannot be fitted is kept)",
    )  # fmt: skip
    p.add_argument(
        "--calibrate-devices-per-node", type=int, default=None,
        help="devices per node of the measured run (default: inferred from its inter-node rows)",
    )  # fmt: skip
    return p


def table(result: Plan) -> str:
    c = result.cluster
    flat = result.estimates[0]
    mib = result.gradient_bytes / 2**20
    width = max(34, *(len(e.name) + 2 for e in result.estimates))
    lines = [
        f"{c.nodes} node(s) x {c.devices_per_node} device(s); gradients {mib:.1f} MiB; intra "
        f"{c.intra_bandwidth / 1e9:.3g} GB/s per device, inter {c.inter_bandwidth * 8 / 1e9:.3g} Gbit/s per "
        f"node, latency {c.latency * 1e6:.3g} us",
        f"{'technique':<{width}}{'comm ms':>10}{'exposed ms':>12}{'inter MiB/node':>16}{'vs ddp':>8}",
    ]
    for e in result.estimates:
        # no ratio where ddp exposes nothing (one device: no communication at all)
        exposed = flat.exposed_seconds
        ratio = f"{e.exposed_seconds / exposed:>8.2f}" if exposed > 0 else f"{'-':>8}"
        lines.append(
            f"{e.name:<{width}}{e.seconds * 1e3:>10.2f}{e.exposed_seconds * 1e3:>12.2f}"
            f"{e.inter_bytes_per_node / 2**20:>16.1f}{ratio}" + (f"  ({e.notes})" if e.notes else "")
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        nodes = args.nodes
        if args.world_size is not None and nodes is not None:
            raise ValueError(
                f"give --nodes or --world-size, not both (nodes={nodes}, world_size={args.world_size})."
            )
        if args.world_size is not None:
            if args.world_size < 1:
                raise ValueError(f"world_size must be a positive integer, got {args.world_size}.")
            if args.devices_per_node < 1 or args.world_size % args.devices_per_node:
                raise ValueError(
                    f"devices_per_node={args.devices_per_node} does not divide world_size={args.world_size}."
                )
            nodes = args.world_size // args.devices_per_node
        if nodes is None:
            raise ValueError("give --nodes or --world-size.")
        cluster = Cluster(
            nodes, args.devices_per_node, args.intra_bandwidth, args.inter_bandwidth, args.latency
        )
        if args.calibrate_from:
            calibration = calibrate_from_csv(
                args.calibrate_from, latency=args.latency, devices_per_node=args.calibrate_devices_per_node
            )
            print(calibration.table(cluster))
            print()
            cluster = calibration.apply(cluster)
        activation_mb = args.activation_mb
        if activation_mb is not None and not (math.isfinite(activation_mb) and activation_mb >= 0):
            raise ValueError(f"activation_mb must be a finite number >= 0, got {activation_mb!r}.")
        result = plan(
            cluster, args.params, args.dtype, args.bucket_mb, args.backward, args.slice_weights,
            args.superstep_steps, args.step_compute, args.inter_node_dtype, args.pipeline_stages,
            args.micro_batches, None if activation_mb is None else activation_mb * 2**20,
        )  # fmt: skip
    except ValueError as error:
        print(f"plan: error: {error}", file=sys.stderr)
        return 2
    print(table(result))
    return 0
