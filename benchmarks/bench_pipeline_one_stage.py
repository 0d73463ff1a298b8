"""The pipeline engine's own cost per micro-batch, on one device: ``hier_pipeline`` with one stage
against Lightning accumulating the same micro-batches.

One process (CPU by default, ``--gpu``: CUDA device 0, NCCL with world size 1) trains a deep MLP of
``--layers`` Linear(hidden, hidden) + ReLU blocks with SGD, each optimizer step over ``--batch-size``
samples in ``--micro-batches`` micro-batches:

- ``single``: Lightning's single-device strategy, ``accumulate_grad_batches=M`` on batches of B / M (the
  same matrix shapes and summation order as the pipeline's micro-batches);
- ``pipeline``: ``HierPipelineStrategy(micro_batches=M, rebalance="never")`` on batches of B;
- ``pipeline_static``: the same with ``static_shapes=True``;
- ``pipeline_timed``: the same with the default ``rebalance="epoch"``, which times one micro-batch per
  step per layer (CUDA events on a GPU).

``--rounds`` fits each, interleaved; prints the median time per optimizer step, the ratio to ``single``
and the engine's extra time per micro-batch, ``(pipeline - single) / M`` (the target for the engine's
own work: <= 0.5 ms per micro-batch per stage)::

    python benchmarks/bench_pipeline_one_stage.py [--gpu] [--rounds 3] [--layers 24] [--hidden 1024]

With one stage nothing is sent: what is left is the engine itself (the traced graph run node by node,
the micro-batch split, the loss and skip broadcast over a one-rank group, the schedule's bookkeeping).
On a GPU, where kernels run asynchronously, the engine's Python is hidden while the device is busier
than the host, and shows where the host is the bound (small layers or batches).
"""

from __future__ import annotations

import statistics

from harness import cli, jobs, report

WORKER = jobs.BENCH_DIR / "_pipeline_one_stage_worker.py"
TARGET_MS = 0.5
OPTIONS = """
--modes          str   single,pipeline,pipeline_static  single, pipeline, pipeline_static, pipeline_timed
--rounds         int   3                                fits per mode
--warmup         int   5                                optimizer steps before the measured window
--steps          int   30                               measured optimizer steps per fit
--hidden         int   1024                             MLP width
--layers         int   24                               Linear(hidden, hidden) + ReLU blocks
--batch-size     int   256                              samples per optimizer step
--micro-batches  int   4                                micro-batches per optimizer step
--gpu            flag  -                                CUDA device 0 (NCCL) instead of the CPU (gloo)
"""


def main(argv: list[str] | None = None) -> None:
    run_options = cli.RUN_OPTIONS.format(timeout=900, per="job", logs="the job's temp dir")
    args = cli.parser(__doc__, OPTIONS, run_options).parse_args(argv)
    jobs.exit_on_sigterm()
    config = jobs.pick(args, "rounds", "warmup", "steps", "hidden", "layers", "batch_size", "micro_batches")
    config["modes"], config["gpu"] = cli.comma_list(args.modes), args.gpu
    if args.batch_size % args.micro_batches:
        raise SystemExit(
            f"--batch-size {args.batch_size} must divide into {args.micro_batches} micro-batches"
        )
    with jobs.job_dir("lhbench-onestage-", args.keep_logs, show=True) as workdir:
        result = jobs.run_to_result(1, WORKER, config, workdir, args.timeout)
    times = result["step_times_s"]
    medians = {mode: statistics.median(t) for mode, t in times.items()}
    single = medians.get("single")
    rows = []
    for mode, t in times.items():
        extra = (medians[mode] - single) / args.micro_batches * 1e3 if single else None
        rows.append([
            mode, f"{medians[mode] * 1e3:.2f}", f"{min(t) * 1e3:.2f}-{max(t) * 1e3:.2f}",
            report.fmt(medians[mode] / single, ".3f") if single else "n/a",
            f"{extra:+.3f}" if extra is not None and mode != "single" else "",
        ])  # fmt: skip
    shape = f"{args.layers} x Linear({args.hidden}, {args.hidden}), batch {args.batch_size}"
    print(f"device: {result['device']}; {shape} in {args.micro_batches} micro-batches, "
          f"{args.steps} steps x {args.rounds} fits")  # fmt: skip
    header = ["mode", "median step [ms]", "range [ms]", "/ single", "extra per micro-batch [ms]"]
    print(report.md_table(header, rows, tight_rule=False))
    print(f"target: the engine's extra per micro-batch <= {TARGET_MS} ms")
    json_out = args.json_out or jobs.RESULTS_DIR / "pipeline_one_stage.json"
    report.write_json(json_out, {"config": report.config(args), "device": result["device"],
                                 "medians_s": medians, "step_times_s": times}, make_dir=True)  # fmt: skip
    print(f"wrote {json_out}")


if __name__ == "__main__":
    main()
