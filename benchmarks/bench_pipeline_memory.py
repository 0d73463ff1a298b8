"""``hier_pipeline``'s per-layer memory policy vs recomputing everything, same cap (benchmarks/README.md)."""

from __future__ import annotations

import json
from typing import Any

from harness import cli, jobs, report

WORKER = jobs.BENCH_DIR / "_pipeline_worker.py"
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


def mib(n: float) -> str:
    """Bytes in MiB, one decimal."""
    return f"{n / 2**20:.1f}"


def run_policy(config: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One job with ``config``: rank 0's results; raises when it fails."""
    print(f"{config['policy']} ...", flush=True)
    with jobs.job_dir("lhbench-mem-", keep=False) as workdir:
        argv = [json.dumps({"mode": "memory", **config}), str(workdir)]
        with jobs.torchrun(2, WORKER, argv, workdir, jobs.worker_env(PYTHONWARNINGS="ignore")) as proc:
            code = proc.wait(timeout=timeout)
        if code != 0 or not (workdir / "rank0.json").exists():
            raise RuntimeError(f"{config['policy']} failed:\n{jobs.tail(workdir / 'job.log', 60)}")
        return json.loads((workdir / "rank0.json").read_text())


def table(results: dict[str, dict[str, Any]], cap: int) -> str:
    """Throughput, peaks and plans of every policy."""
    rows = []
    for name, r in results.items():
        peaks = [s["measured_peak_bytes"] for s in r["stages"]]
        under = "-" if name == "keep" else ("yes" if max(peaks) <= cap else "**no**")
        ratio = f"{r['samples_per_s'] / results[REFERENCE]['samples_per_s']:.3f}"
        plans = " / ".join(str(s["plan"]) for s in r["stages"])
        rows.append([name, f"{r['samples_per_s']:.1f}", ratio, mib(peaks[0]), mib(peaks[1]), under, plans])
    header = ["policy", "samples/s", "vs recompute", "stage 0 peak [MiB]", "stage 1 peak [MiB]", "under cap"]
    return report.md_table([*header, "plans"], rows, tight_rule=False)


def draw(plt: Any, results: dict[str, dict[str, Any]], cap: int) -> Any:
    """Each stage's measured peak against the cap, and the throughput, per policy."""
    names = list(results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for s in range(2):
        peaks = [results[n]["stages"][s]["measured_peak_bytes"] / 2**20 for n in names]
        left.bar([i + (s - 0.5) * 0.38 for i in range(len(names))], peaks, width=0.38, label=f"stage {s}")
    left.axhline(cap / 2**20, color="k", linestyle="--", label="memory_limit")
    left.set(xticks=range(len(names)), xticklabels=names, ylabel="measured peak [MiB]")
    left.legend(fontsize=7)
    right.bar(names, [results[n]["samples_per_s"] for n in names], color=["#999", "#1f77b4", "#d62728"])
    right.set_ylabel("samples / s")
    fig.suptitle("hier_pipeline memory policy, 2 stages x 1F1B, 8 micro-batches (CPU)")
    return fig


def main(argv: list[str] | None = None) -> None:
    """Run keep, then auto and recompute under the cap keep's peaks give; print, write JSON and a figure."""
    args = cli.parser(__doc__, OPTIONS).parse_args(argv)
    base = jobs.pick(args, "width", "blocks", "batch_size", "micro_batches", "warmup", "steps")
    results = {"keep": run_policy({**base, "policy": "keep"}, args.timeout)}
    # the fuller stage must shed half of the activations it stashed under keep
    cap = max(s["base_bytes"] + s["activation_peak_bytes"] // 2 for s in results["keep"]["stages"])
    print(f"memory_limit = {mib(cap)} MiB per stage", flush=True)
    for policy in (CONTENDER, REFERENCE):
        results[policy] = run_policy({**base, "policy": policy, "memory_limit": cap}, args.timeout)
    rate, ref = results[CONTENDER]["samples_per_s"], results[REFERENCE]["samples_per_s"]
    print("\n" + table(results, cap))
    met = "met" if rate / ref >= TARGET else "NOT met"
    ratio = f"{CONTENDER} {rate:.1f} / {REFERENCE} {ref:.1f} samples/s = {rate / ref:.3f}"
    print(f"\n{ratio} (target >= {TARGET}: {met})")
    path = jobs.RESULTS_DIR / "pipeline_memory.json"
    report.write_json(path, {"cap": cap, "results": results}, make_dir=True)
    drawn = report.save_figure(path.with_suffix(".png"), lambda plt: draw(plt, results, cap), dpi=100)
    figure_note = f" and {path.with_suffix('.png')}" if drawn else " (no figure: pip install matplotlib)"
    print(f"wrote {path}{figure_note}")


if __name__ == "__main__":
    main()
