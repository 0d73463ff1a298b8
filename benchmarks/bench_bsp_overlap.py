"""hier_bsp in plain BSP: buckets pushed during backward (``_early_push=True``) vs after it, vs ``ddp``;
with ``--modes ...,time``, also early push of buckets planned from gradient-ready times
(``bucketing="time"``).

Each contender runs as one ``torch.distributed.run --standalone`` job of ``--processes`` CPU processes
(gloo) training the same MLP; the driver runs the contenders ``--repeats`` times, interleaved, and
prints each one's median step time and the ratios early / late and early / ddp (no target: on CPU
the overlap competes with backward for the cores, see docs/hier_bsp.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_bsp_overlap_worker.py"
MODES = ("early", "late", "time", "ddp")


def run_job(args: argparse.Namespace, mode: str) -> dict:
    """One job; its rank 0's result line."""
    config = {k: getattr(args, k) for k in ("processes", "hidden", "layers", "batch_size", "warmup", "steps")}
    config.update(mode=mode, bucket_cap_mb=args.bucket_cap_mb)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE)}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [*launcher, f"--nproc_per_node={args.processes}", str(WORKER), json.dumps(config)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        log = f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        raise RuntimeError(f"{mode} failed ({done.returncode}):\n{log}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main(argv: list[str] | None = None) -> int:
    """Run the contenders, interleaved; print medians and ratios."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--bucket-cap-mb", type=float, default=4.0)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--modes", default="early,late,ddp", help=f"comma-separated, of {', '.join(MODES)}")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := set(modes) - set(MODES):
        p.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    for repeat in range(args.repeats):
        for mode in modes:
            result = run_job(args, mode)
            results[mode].append(result)
            extra = ""
            if mode != "ddp":
                extra = f", {result['early_buckets']:.1f} of {result['buckets']} buckets early"
            print(f"[repeat {repeat + 1}] {mode:<5} {result['step_ms']:.1f} ms per step{extra}", flush=True)
    median = {mode: statistics.median(r["step_ms"] for r in runs) for mode, runs in results.items()}
    print("\nmedian step [ms]: " + ", ".join(f"{mode} {ms:.1f}" for mode, ms in median.items()))
    pairs = [("early", "late"), ("early", "ddp"), ("time", "early"), ("time", "ddp")]
    ratios = [f"{a} / {b}: {median[a] / median[b]:.3f}" for a, b in pairs if a in median and b in median]
    print("   ".join(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
