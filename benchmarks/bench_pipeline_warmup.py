"""Extra 1F1B warm-up forwards against none, in one run: ``hier_pipeline`` on a fixed split where the
first stage is the slower one, switching ``extra_warmup`` between 0 and ``--extra`` every ``--block``
steps on every rank, so that both settings meet the same host load (on a shared 2-core CPU the speed
drifts by 10-25 % between runs minutes apart, more than the effect measured here).

Prints the median step time of each setting and their ratio (below 1: the extra forwards pay)::

    python benchmarks/bench_pipeline_warmup.py [--partition 12,4] [--extra 1] [--steps 600]

The default is a skewed stack (9 narrow blocks, then 7 wide ones, batch 512 in 4 micro-batches)
on the split the rebalancer finds for it (12 and 4 blocks): stage 0 about 13.7 ms per micro-batch, stage
1 about 11.9 ms. There ``extra_warmup="auto"`` chooses one extra forward on stage 0
(``lightning_hier/pipeline/warmup.py`` simulates 64.9 -> 61.3 ms).
"""

from __future__ import annotations

import statistics

from harness import cli, jobs, report

WORKER = jobs.BENCH_DIR / "_pipeline_warmup_worker.py"
OPTIONS = """
--partition      str   12,4         blocks per stage (one process per stage)
--model          str   narrow-first narrow-first (the skewed stack) or heavy-first
--batch-size     int   512          samples per step
--micro-batches  int   4            micro-batches per step
--extra          int   1            extra warm-up forwards per stage in the contender's blocks
--block          int   5            steps per block of one setting
--steps          int   600          measured steps (both settings together)
--warmup         int   20           steps before the measured ones
--dynamic-shapes flag  -            without static_shapes (a header ahead of every activation)
"""


def main(argv: list[str] | None = None) -> None:
    run_options = cli.RUN_OPTIONS.format(timeout=900, per="job", logs="the job's temp dir")
    args = cli.parser(__doc__, OPTIONS, run_options).parse_args(argv)
    jobs.exit_on_sigterm()
    config = jobs.pick(args, "model", "batch_size", "micro_batches", "extra", "block", "steps", "warmup")
    config["partition"] = [int(v) for v in cli.comma_list(args.partition)]
    config["static_shapes"] = not args.dynamic_shapes
    if args.batch_size % args.micro_batches:
        raise SystemExit(
            f"--batch-size {args.batch_size} must divide into {args.micro_batches} micro-batches"
        )
    stages = len(config["partition"])
    with jobs.job_dir("lhbench-warmup-", args.keep_logs, show=True) as workdir:
        result = jobs.run_to_result(stages, WORKER, config, workdir, args.timeout)
    times = result["step_times_s"]
    medians = {setting: statistics.median(t) for setting, t in times.items()}
    rows = [
        [setting, str(len(t)), f"{medians[setting] * 1e3:.2f}", f"{min(t) * 1e3:.2f}-{max(t) * 1e3:.2f}"]
        for setting, t in times.items()
    ]
    print(f"{stages} stages, blocks per stage {args.partition}, {args.model}, batch {args.batch_size} in "
          f"{args.micro_batches} micro-batches, settings alternating every {args.block} steps")  # fmt: skip
    print(
        report.md_table(["extra warm-up", "steps", "median step [ms]", "range [ms]"], rows, tight_rule=False)
    )
    ratio = medians[str(args.extra)] / medians["0"]
    print(f"extra {args.extra} / none = {ratio:.3f} (below 1: the extra forwards shorten the step)")
    json_out = args.json_out or jobs.RESULTS_DIR / "pipeline_warmup.json"
    report.write_json(json_out, {"config": report.config(args), "medians_s": medians, "ratio": ratio,
                                 "step_times_s": times}, make_dir=True)  # fmt: skip
    print(f"wrote {json_out}")


if __name__ == "__main__":
    main()
