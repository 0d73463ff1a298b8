"""``CommProfiler``'s overhead: step time with and without it, per strategy, in one job.

Four CPU processes train the harness MLP under Lightning ``ddp`` and ``hier_sliced`` (2 x 2), and on
request ``hier_bsp`` (plain BSP, 2 x 2) and ``hier_pipeline`` (4 stages, 4 micro-batches). By default
each of ``--rounds`` fits switches ``CommProfiler`` on and off every ``--block`` steps (off: its wrapping
undone, truly absent), so that steps with and without it share the host's drift; the round's figure is
the median step time of its on steps against that of its off steps. ``--block 0`` runs separate fits
instead, as many with as without (interleaved, alternating who goes first). The overhead is the ratio
of the medians over the rounds (target <= 1.03); beside it, the CPU seconds per step summed over every
thread of every rank, with and without (on a 2-core CPU the step time follows the total CPU work)::

    python benchmarks/bench_comm_profiler.py [--rounds 3] [--steps 200] [--block 10]

``--gpu``: one process on the first CUDA device instead (NCCL with world size 1, CommProfiler's
CUDA-event clock; step times taken after ``torch.cuda.synchronize``).
"""

from __future__ import annotations

import statistics
from typing import Any

from harness import cli, jobs, report

WORKER = jobs.BENCH_DIR / "_comm_profiler_worker.py"
TARGET = 1.03
OPTIONS = """
--strategies str   ddp,hier_sliced  ddp, hier_sliced, hier_bsp, hier_pipeline, ddp_python_hook (a Python hook)
--rounds     int   3                fits per strategy (--block 0: as many with as without the profiler)
--block      int   10               profiler on and off every N steps within a fit (0: separate fits)
--warmup     int   3                steps before the measured window of each fit
--steps      int   200              measured steps per fit
--hidden     int   512              MLP width
--layers     int   4                Linear(hidden, hidden) layers
--batch-size int   16               per process
--gpu        flag  -                one process on CUDA device 0 (NCCL) instead of four CPU processes
--time-every int   0                CommProfiler(time_every_n_steps=N), N-th steps timed (0: its default)
"""


def summarize(times: dict[str, list[float]]) -> dict[str, Any]:
    """Medians with and without, their ratio and the per-round ratios' range."""
    without, with_ = statistics.median(times["without"]), statistics.median(times["with"])
    rounds = [w / o for w, o in zip(times["with"], times["without"])]
    cpu_without, cpu_with = statistics.median(times["cpu_without"]), statistics.median(times["cpu_with"])
    return {"median_without_s": without, "median_with_s": with_, "ratio": with_ / without,
            "round_ratio_min": min(rounds), "round_ratio_max": max(rounds),
            "cpu_per_step_without_s": cpu_without, "cpu_per_step_with_s": cpu_with,
            "cpu_ratio": cpu_with / cpu_without}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    run_options = cli.RUN_OPTIONS.format(timeout=900, per="job", logs="the job's temp dir")
    args = cli.parser(__doc__, OPTIONS, run_options, cli.IDLE_OPTIONS.format(job="job")).parse_args(argv)
    jobs.exit_on_sigterm()
    names = ("rounds", "block", "warmup", "steps", "hidden", "layers", "batch_size", "time_every")
    config = jobs.pick(args, *names)
    config["strategies"] = cli.comma_list(args.strategies)
    config["gpu"] = args.gpu
    if args.wait_idle > 0:
        jobs.wait_idle(args.wait_idle)
    with jobs.job_dir("lhbench-commprof-", args.keep_logs, show=True) as workdir:
        before = jobs.cpu_snapshot()
        results = jobs.run_to_result(1 if args.gpu else 4, WORKER, config, workdir, args.timeout)
        other = jobs.other_cores(before, jobs.cpu_snapshot())
    summaries = {name: summarize(times) for name, times in results.items()}
    rows = [
        [name, f"{s['median_without_s'] * 1e3:.2f}", f"{s['median_with_s'] * 1e3:.2f}", f"{s['ratio']:.3f}",
         f"{s['round_ratio_min']:.3f}-{s['round_ratio_max']:.3f}",
         "MET" if s["ratio"] <= TARGET else "NOT MET",
         f"{s['cpu_per_step_without_s'] * 1e3:.1f} / {s['cpu_per_step_with_s'] * 1e3:.1f} "
         f"({s['cpu_ratio']:.3f})"]
        for name, s in summaries.items()
    ]  # fmt: skip
    header = ["strategy", "step without [ms]", "step with [ms]", "with / without", "per round", "<= 1.03",
              "CPU per step, all ranks, without / with [ms]"]  # fmt: skip
    print(report.md_table(header, rows, tight_rule=False))
    print(f"other processes used {other:.2f} cores during the job")
    json_out = args.json_out or jobs.RESULTS_DIR / "comm_profiler.json"
    report.write_json(json_out, {"config": report.config(args), "other_cores": other, "summaries": summaries,
                                 "step_times_s": results}, make_dir=True)  # fmt: skip
    print(f"wrote {json_out}")


if __name__ == "__main__":
    main()
