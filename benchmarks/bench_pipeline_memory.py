"""``hier_pipeline``'s per-layer memory policy vs recomputing everything, under the same cap.

Two stage processes (one per core) train a stack of transformer-MLP-like blocks
(``Linear(W, 4W) -> GELU -> Linear(4W, W)`` plus a residual), each block one layer
(``leaf_modules``), with 1F1B and 8 micro-batches, so stage 0 stashes the activations of two
micro-batches and stage 1 of one. In one run, one ``torch.distributed.run`` job per contender:

* ``keep``: every activation kept (``activation_policy="keep"``), no cap: the memory the cap
  is set against;
* ``auto``: ``memory_limit=cap`` and the keep / swap / recompute policy (the contender);
* ``recompute``: every layer recomputed (``activation_policy="recompute"``), the usual way to
  fit a cap (activation checkpointing of the whole model).

The cap is ``max over stages of (parameters + gradients + optimizer state + half the stashed
activations measured under keep)``: the fuller stage must shed half of its activations. Reported:
samples/s over the measured steps, each stage's measured peak (base bytes + peak of stashed
device-resident activations, from the stage's ``ActivationMeter``), the plans, and the ratio
auto / recompute (target >= 1.2). On CPU "swap" copies saved tensors to separate host buffers:
they leave the activation accounting but not the machine's RAM (on a GPU they leave device
memory); the figures are what the stage's meter measures. No root needed::

    python benchmarks/bench_pipeline_memory.py [--steps 6] [--width 1024] [--blocks 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


# ---------------------------------------------------------------------- worker (under torchrun)
def worker(config: dict[str, Any], out: Path) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hier import HierPipelineStrategy

    width, blocks = config["width"], config["blocks"]

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(nn.functional.gelu(self.up(x)))

    class Stack(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*(Block() for _ in range(blocks)))
            self.head = nn.Linear(width, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(x))

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    steps = config["warmup"] + config["steps"]
    g = torch.Generator().manual_seed(0)
    n = config["batch_size"] * steps
    data = TensorDataset(torch.randn(n, width, generator=g), torch.randint(0, 10, (n,), generator=g))

    step_times: list[float] = []

    class Clock(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
            step_times.append(time.perf_counter() - self.start)

    pl.seed_everything(0, verbose=False)
    strategy = HierPipelineStrategy(
        micro_batches=config["micro_batches"],
        schedule="1f1b",
        partition="uniform",
        rebalance="never",
        profile_steps=config["warmup"] - 1,
        leaf_modules=[f"blocks.{i}" for i in range(blocks)],
        activation_policy=config["policy"],
        memory_limit=config.get("memory_limit"),
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Clock()],
    )
    engine_ref: list[Any] = []

    class ResetPeak(pl.Callback):
        """The measured window starts after the plan: peaks are measured from there on."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
            if batch_idx == config["warmup"] and strategy.engine is not None and strategy.engine.meter:
                strategy.engine.meter.reset_peak()
                engine_ref.append(strategy.engine)

    trainer.callbacks.append(ResetPeak())
    trainer.fit(Stack(), DataLoader(data, batch_size=config["batch_size"]))
    engine = strategy.engine
    assert engine is not None and engine.meter is not None
    mine = {
        "stage": engine.stage,
        "base_bytes": engine.base_bytes(),
        "activation_peak_bytes": engine.meter.peak_bytes,
        "measured_peak_bytes": engine.measured_peak_bytes(),
        "plan": str(engine.memory_plan) if engine.memory_plan is not None else config["policy"],
        "policies": dict(engine.executor.policies),
        # per micro-batch: the stage's own compute (forward + backward of its layers), no waiting
        "compute_s_per_micro_batch": sum(
            f + b for f, b in engine.executor.times.summary(engine.executor.layer_range).values()
        ),
    }
    stages: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(stages, mine)
    if trainer.is_global_zero:
        measured = step_times[config["warmup"] :]
        result = {
            "config": config,
            "stages": sorted(stages, key=lambda s: s["stage"]),
            "step_times_s": measured,
            "samples_per_s": config["batch_size"] * len(measured) / sum(measured),
        }
        out.write_text(json.dumps(result, indent=2))


# ---------------------------------------------------------------------- driver
def run_contender(config: dict[str, Any], timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="lhbench-mem-") as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        env["PYTHONPATH"] = f"{HERE.parent}{os.pathsep}{env.get('PYTHONPATH', '')}"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            __file__, "--worker", json.dumps(config), str(out),
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"{config['policy']} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def draw(results: dict[str, dict[str, Any]], cap: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for s in range(2):
        peaks = [results[n]["stages"][s]["measured_peak_bytes"] / 2**20 for n in names]
        left.bar([i + (s - 0.5) * 0.38 for i in range(len(names))], peaks, width=0.38, label=f"stage {s}")
    left.axhline(cap / 2**20, color="k", linestyle="--", label="memory_limit")
    left.set_xticks(range(len(names)), names)
    left.set_ylabel("measured peak [MiB]")
    left.legend(fontsize=7)
    right.bar(names, [results[n]["samples_per_s"] for n in names], color=["#999", "#1f77b4", "#d62728"])
    right.set_ylabel("samples / s")
    fig.suptitle("hier_pipeline memory policy, 2 stages x 1F1B, 8 micro-batches (CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument(
        "--warmup", type=int, default=3, help="steps before the measured window (plan at the last)"
    )
    p.add_argument("--steps", type=int, default=6, help="measured steps")
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args(argv)
    base = {
        "width": args.width,
        "blocks": args.blocks,
        "batch_size": args.batch_size,
        "micro_batches": args.micro_batches,
        "warmup": args.warmup,
        "steps": args.steps,
    }
    results: dict[str, dict[str, Any]] = {}
    print("keep (no cap) ...", flush=True)
    results["keep"] = run_contender({**base, "policy": "keep"}, args.timeout)
    cap = max(s["base_bytes"] + s["activation_peak_bytes"] // 2 for s in results["keep"]["stages"])
    print(f"cap = {mib(cap)} MiB; auto ...", flush=True)
    results["auto"] = run_contender({**base, "policy": "auto", "memory_limit": cap}, args.timeout)
    print("recompute everything ...", flush=True)
    results["recompute"] = run_contender({**base, "policy": "recompute", "memory_limit": cap}, args.timeout)

    print(f"\nmemory_limit = {mib(cap)} MiB per stage\n")
    header = (
        "| policy | samples/s | vs recompute | stage 0 peak [MiB] | stage 1 peak [MiB] | under cap | plans |"
    )
    print(header)
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        peaks = [s["measured_peak_bytes"] for s in r["stages"]]
        under = "-" if name == "keep" else ("yes" if max(peaks) <= cap else "**no**")
        ratio = r["samples_per_s"] / results["recompute"]["samples_per_s"]
        plans = " / ".join(str(s["plan"]) for s in r["stages"])
        cells = [
            name,
            f"{r['samples_per_s']:.1f}",
            f"{ratio:.3f}",
            mib(peaks[0]),
            mib(peaks[1]),
            under,
            plans,
        ]
        print("| " + " | ".join(cells) + " |")
    ratio = results["auto"]["samples_per_s"] / results["recompute"]["samples_per_s"]
    print(
        f"\nauto / recompute throughput: {ratio:.3f} (target >= 1.2: {'met' if ratio >= 1.2 else 'NOT met'})"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pipeline_memory.json").write_text(json.dumps({"cap": cap, "results": results}, indent=2))
    try:
        draw(results, cap, RESULTS / "pipeline_memory.png")
        print(f"figure: {RESULTS / 'pipeline_memory.png'}")
    except ImportError:
        print("install matplotlib for the figure")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]), Path(sys.argv[3]))
    else:
        main()
