"""Each strategy's own host work per step, on one device: the package's strategies against Lightning's
``ddp`` where nothing is communicated.

One process (CPU by default, ``--gpu``: CUDA device 0, NCCL with world size 1) trains an MLP of
``--layers`` Linear(hidden, hidden) blocks with SGD under each of ``--strategies`` (``ddp``,
``hier_sliced``, ``hier_bsp`` in plain BSP, ``hier_pipeline`` with one stage and one micro-batch).
With one process every reduction is skipped, so what differs is the strategy's Python per step: its
gradient hooks (one per parameter tensor per backward), its checks and its bookkeeping. Deep narrow
layers (many parameter tensors, little arithmetic) make the host the bound, as small models and large
clusters do on GPUs, where the host must stay ahead of the device.

``--rounds`` fits each, interleaved; prints the median step, the main thread's CPU time per step, and
the ratio to ``ddp``; with ``--gpu`` also the host-device synchronisations per step that the strategy
makes (``torch.cuda.set_sync_debug_mode``: each one stops the host from running ahead)::

    python benchmarks/bench_host_overhead.py [--gpu] [--rounds 3] [--layers 64] [--hidden 32]
"""

from __future__ import annotations

import statistics

from harness import cli, jobs, report

WORKER = jobs.BENCH_DIR / "_host_overhead_worker.py"
OPTIONS = """
--strategies  str   ddp,hier_sliced,hier_bsp,hier_pipeline  ddp, hier_sliced, hier_bsp, hier_pipeline
--rounds      int   3                                       fits per strategy
--warmup      int   10                                      steps before the measured window
--steps       int   100                                     measured steps per fit
--hidden      int   32                                      MLP width
--layers      int   64                                      Linear(hidden, hidden) blocks (2 tensors each)
--batch-size  int   8                                       samples per step
--gpu         flag  -                                       CUDA device 0 (NCCL) instead of the CPU (gloo)
"""


def main(argv: list[str] | None = None) -> None:
    run_options = cli.RUN_OPTIONS.format(timeout=900, per="job", logs="the job's temp dir")
    args = cli.parser(__doc__, OPTIONS, run_options).parse_args(argv)
    jobs.exit_on_sigterm()
    config = jobs.pick(args, "rounds", "warmup", "steps", "hidden", "layers", "batch_size")
    config["strategies"], config["gpu"] = cli.comma_list(args.strategies), args.gpu
    with jobs.job_dir("lhbench-host-", args.keep_logs, show=True) as workdir:
        result = jobs.run_to_result(1, WORKER, config, workdir, args.timeout)
    runs = result["runs"]
    medians = {name: statistics.median(r["step_s"]) for name, r in runs.items()}
    cpu = {name: statistics.median(r["cpu_s"]) for name, r in runs.items()}
    reference = medians.get("ddp")
    rows = []
    for name, r in runs.items():
        rows.append([
            name, f"{medians[name] * 1e3:.2f}", f"{min(r['step_s']) * 1e3:.2f}-{max(r['step_s']) * 1e3:.2f}",
            f"{cpu[name] * 1e3:.2f}", report.fmt(medians[name] / reference, ".3f") if reference else "n/a",
            report.fmt(statistics.median(r["syncs_per_step"]), ".2f") if args.gpu else "n/a",
        ])  # fmt: skip
    print(f"device: {result['device']}; {args.layers} x Linear({args.hidden}, {args.hidden}), batch "
          f"{args.batch_size}, {args.steps} steps x {args.rounds} fits")  # fmt: skip
    header = [
        "strategy",
        "median step [ms]",
        "range [ms]",
        "main-thread CPU [ms/step]",
        "/ ddp",
        "syncs/step",
    ]
    print(report.md_table(header, rows, tight_rule=False))
    json_out = args.json_out or jobs.RESULTS_DIR / "host_overhead.json"
    report.write_json(json_out, {"config": report.config(args), **result}, make_dir=True)
    print(f"wrote {json_out}")


if __name__ == "__main__":
    main()
