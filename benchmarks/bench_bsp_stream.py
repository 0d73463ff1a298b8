"""``hier_bsp`` on a GPU: the local BSP module on a stream of its own against the worker's stream.

One process on CUDA device 0 (NCCL, world size 1) trains an MLP with Adam under Lightning ``ddp``, under
``hier_bsp`` (``superstep=1``, ``max_staleness=1``: the server applies step n while the worker
computes step n + 1), and under ``hier_bsp`` with the module put back on the worker's stream (without
``StreamHandoff``), ``--rounds`` fits each, interleaved. Prints the median step times and their ratios::

    python benchmarks/bench_bsp_stream.py [--rounds 3] [--hidden 4096] [--layers 8]

With one device nothing crosses a link: what the module's own stream buys here is the server's optimizer
step and copies running beside the worker's next forward and backward instead of behind them.
"""

from __future__ import annotations

import statistics

from harness import cli, jobs, report

WORKER = jobs.BENCH_DIR / "_bsp_stream_worker.py"
OPTIONS = """
--modes         str   ddp,bsp,bsp_worker_stream  comma-separated: ddp, bsp, bsp_worker_stream
--rounds        int   3                          fits per mode
--warmup        int   5                          steps before the measured window of each fit
--steps         int   30                         measured steps per fit
--hidden        int   4096                       MLP width
--layers        int   8                          Linear(hidden, hidden) layers
--batch-size    int   256                        per step
--max-staleness int   1                          hier_bsp's bound (0: plain BSP, no overlap possible)
"""


def main(argv: list[str] | None = None) -> None:
    run_options = cli.RUN_OPTIONS.format(timeout=600, per="job", logs="the job's temp dir")
    args = cli.parser(__doc__, OPTIONS, run_options).parse_args(argv)
    jobs.exit_on_sigterm()
    config = jobs.pick(args, "rounds", "warmup", "steps", "hidden", "layers", "batch_size", "max_staleness")
    config["modes"] = cli.comma_list(args.modes)
    with jobs.job_dir("lhbench-bspstream-", args.keep_logs, show=True) as workdir:
        times = jobs.run_to_result(1, WORKER, config, workdir, args.timeout)
    medians = {mode: statistics.median(t) for mode, t in times.items()}
    reference = medians.get("ddp")
    rows = [
        [mode, f"{medians[mode] * 1e3:.2f}", f"{min(t) * 1e3:.2f}-{max(t) * 1e3:.2f}",
         report.fmt(medians[mode] / reference, ".3f") if reference else "n/a"]
        for mode, t in times.items()
    ]  # fmt: skip
    print(report.md_table(["mode", "median step [ms]", "range [ms]", "/ ddp"], rows, tight_rule=False))
    if "bsp" in medians and "bsp_worker_stream" in medians:
        print(f"own stream / worker's stream: {medians['bsp'] / medians['bsp_worker_stream']:.3f}")
    json_out = args.json_out or jobs.RESULTS_DIR / "bsp_stream.json"
    report.write_json(json_out, {"config": report.config(args), "medians_s": medians, "step_times_s": times},
                      make_dir=True)  # fmt: skip
    print(f"wrote {json_out}")


if __name__ == "__main__":
    main()
