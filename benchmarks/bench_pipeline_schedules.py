"""What pipelining can buy at all on the machine it runs on: torch's own schedules against one process.

The target for the rebalanced 2-stage pipeline is >= 1.4x one process's throughput on the skewed
stack (``--model narrow-first``, batch 512 in 4 micro-batches). This benchmark takes the engine out: it
trains the same 16 blocks with ``torch.distributed.pipelining``'s hand-built ``PipelineStage``s (gloo, one
process per core) under ``Schedule1F1B`` on a 2-stage split, and under the zero-bubble schedules
(``ScheduleZBVZeroBubble``, ``ScheduleInterleavedZeroBubble``) and ``ScheduleInterleaved1F1B`` on a 4-stage
split (two stages per process), against one process training the whole stack (a plain torch loop, one
batch per step). ``--rounds`` jobs of each, interleaved; it prints the median samples/s and the ratio to
one process::

    python benchmarks/bench_pipeline_schedules.py [--rounds 3] [--split 0,12] [--split4 0,11,13,15]

The defaults are the splits that were fastest on a 2-core CPU: ``0,12`` is the split the engine's
rebalancing settles on; ``0,11,13,15`` the best of the 4-stage splits tried (benchmarks/README.md).
"""

from __future__ import annotations

import statistics

from harness import cli, jobs, report

WORKER = jobs.BENCH_DIR / "_pipeline_schedules_worker.py"
TARGET = 1.4
OPTIONS = """
--schedules      str   single,1f1b,zbv,interleaved_zb,interleaved_1f1b  contenders (single: one process)
--rounds         int   3           jobs per schedule, interleaved
--warmup         int   8           steps before the measured ones
--steps          int   24          measured steps per job
--batch-size     int   512         samples per step
--micro-batches  int   4           micro-batches per step
--model {heavy-first,narrow-first} narrow-first  the blocks' widths (as bench_pipeline.py)
--split          str   0,12        first block of each of the 2 stages (1f1b)
--split4         str   0,11,13,15  first block of each of the 4 stages (the other schedules)
"""


def main(argv: list[str] | None = None) -> None:
    run_options = cli.RUN_OPTIONS.format(timeout=600, per="job", logs="the job's temp dir")
    args = cli.parser(__doc__, OPTIONS, run_options).parse_args(argv)
    jobs.exit_on_sigterm()
    if args.batch_size % args.micro_batches:
        raise SystemExit(f"--batch-size {args.batch_size} must divide into {args.micro_batches} parts")
    common = jobs.pick(args, "warmup", "steps", "batch_size", "micro_batches", "model")
    splits = {2: [int(s) for s in args.split.split(",")], 4: [int(s) for s in args.split4.split(",")]}
    names = cli.comma_list(args.schedules)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        for name in names:
            split = splits[2] if name == "1f1b" else splits[4]
            config = {**common, "schedule": name, "split": None if name == "single" else split}
            with jobs.job_dir(f"lhbench-sched-{name}-", args.keep_logs, show=False) as workdir:
                processes = 1 if name == "single" else 2
                result = jobs.run_to_result(processes, WORKER, config, workdir, args.timeout)
            step_s = statistics.median(result["step_times_s"])
            times[name].append(step_s)
            samples_per_s = args.batch_size / step_s
            print(f"  round {round_index + 1} {name:17s} {samples_per_s:9,.0f} samples/s", flush=True)
    throughput = {name: [args.batch_size / t for t in ts] for name, ts in times.items()}
    medians = {name: statistics.median(v) for name, v in throughput.items()}
    single = medians.get("single")
    rows = [
        [
            name,
            f"{medians[name]:,.0f}",
            f"{min(v):,.0f}-{max(v):,.0f}",
            report.fmt(medians[name] / single, ".2f") if single else "n/a",
            "" if name == "single" else (args.split if name == "1f1b" else args.split4),
        ]
        for name, v in throughput.items()
    ]
    print(f"{args.model}, batch {args.batch_size} in {args.micro_batches} micro-batches, 2 processes on gloo")
    print(report.md_table(["schedule", "samples/s (median)", "range", "/ one process", "split"], rows, False))
    if single:
        best = max((n for n in medians if n != "single"), key=medians.get, default=None)
        if best is not None:
            verdict = "reached" if medians[best] / single >= TARGET else "NOT reached"
            print(f"best schedule {best}: {medians[best] / single:.2f}x one process ({TARGET}x {verdict})")
    json_out = args.json_out or jobs.RESULTS_DIR / "pipeline_schedules.json"
    report.write_json(json_out, {"config": report.config(args), "step_s": times}, make_dir=True)
    print(f"wrote {json_out}")


if __name__ == "__main__":
    main()
