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

import json
from typing import Any

from harness import cli, jobs, report

WORKER = jobs.BENCH_DIR / "_pipeline_memory_worker.py"
CONTENDER, REFERENCE, TARGET = "auto", "recompute", 1.2
OPTIONS = """
--width         int    1024
--blocks        int    8
--batch-size    int    1024
--micro-batches int    8
--warmup        int    3    steps before the measured window (plan at the last)
--steps         int    6    measured steps
--timeout       float  600
"""


def run_contender(config: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One job of 2 stage processes with ``config``: rank 0's results; raises when it fails."""
    with jobs.job_dir("lhbench-mem-", keep=False) as workdir:
        out = workdir / "result.json"
        argv, env = [json.dumps(config), str(out)], jobs.worker_env(PYTHONWARNINGS="ignore")
        with jobs.torchrun(2, WORKER, argv, workdir, env) as proc:
            code = proc.wait(timeout=timeout)
        if code != 0 or not out.exists():
            raise RuntimeError(f"{config['policy']} failed:\n{jobs.tail(workdir / 'job.log', 60)}")
        return json.loads(out.read_text())


def mib(n: float) -> str:
    """Bytes in MiB, one decimal."""
    return f"{n / 2**20:.1f}"


def draw(plt: Any, results: dict[str, dict[str, Any]], cap: int) -> Any:
    """Each stage's measured peak against the cap, and the throughput, per policy."""
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
    return fig


def table(results: dict[str, dict[str, Any]], cap: int) -> str:
    """Throughput, peaks and plans of every policy."""
    rows = []
    for name, r in results.items():
        peaks = [s["measured_peak_bytes"] for s in r["stages"]]
        under = "-" if name == "keep" else ("yes" if max(peaks) <= cap else "**no**")
        ratio = r["samples_per_s"] / results[REFERENCE]["samples_per_s"]
        plans = " / ".join(str(s["plan"]) for s in r["stages"])
        rows.append(
            [name, f"{r['samples_per_s']:.1f}", f"{ratio:.3f}", mib(peaks[0]), mib(peaks[1]), under, plans]
        )
    header = ["policy", "samples/s", "vs recompute", "stage 0 peak [MiB]", "stage 1 peak [MiB]", "under cap"]
    return report.md_table([*header, "plans"], rows, tight_rule=False)


def main(argv: list[str] | None = None) -> None:
    """Run keep, then auto and recompute under the cap keep's peaks give; print, write JSON and a figure."""
    args = cli.parser(__doc__, OPTIONS).parse_args(argv)
    base = jobs.pick(args, "width", "blocks", "batch_size", "micro_batches", "warmup", "steps")
    results: dict[str, dict[str, Any]] = {}
    print("keep (no cap) ...", flush=True)
    results["keep"] = run_contender({**base, "policy": "keep"}, args.timeout)
    cap = max(s["base_bytes"] + s["activation_peak_bytes"] // 2 for s in results["keep"]["stages"])
    print(f"cap = {mib(cap)} MiB; auto ...", flush=True)
    results[CONTENDER] = run_contender({**base, "policy": CONTENDER, "memory_limit": cap}, args.timeout)
    print("recompute everything ...", flush=True)
    results[REFERENCE] = run_contender({**base, "policy": REFERENCE, "memory_limit": cap}, args.timeout)

    print(f"\nmemory_limit = {mib(cap)} MiB per stage\n")
    print(table(results, cap))
    ratio = results[CONTENDER]["samples_per_s"] / results[REFERENCE]["samples_per_s"]
    met = "met" if ratio >= TARGET else "NOT met"
    print(f"\nauto / recompute throughput: {ratio:.3f} (target >= {TARGET}: {met})")
    report.write_json(
        jobs.RESULTS_DIR / "pipeline_memory.json", {"cap": cap, "results": results}, make_dir=True
    )
    figure = jobs.RESULTS_DIR / "pipeline_memory.png"
    if report.save_figure(figure, lambda plt: draw(plt, results, cap), dpi=100):
        print(f"figure: {figure}")
    else:
        print("install matplotlib for the figure")


if __name__ == "__main__":
    main()
