"""``hier_bsp`` vs ``ddp`` vs post-local SGD: wall time to a target accuracy, with and without a straggler.

Four CPU processes, one ``torch.distributed.run`` job per contender and scenario, train the digits MLP
(same seed, data, SGD and batch) until val_acc reaches ``--target-acc`` or ``--max-epochs``; scenarios
``straggler`` (rank 3 at half speed; each run stops at the target) and ``even`` (``--even-epochs``
epochs for every contender, final accuracies compared). Contenders, measures, targets: benchmarks/README.md::

    python benchmarks/bench_bsp.py [--scenarios straggler,even] [--target-acc 0.9] [--max-epochs 20]
"""

from __future__ import annotations

import argparse
import json
import subprocess
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from harness import cli, jobs, report

WORKER = jobs.BENCH_DIR / "_bsp_worker.py"
NPROC, STRAGGLER_RANK = 4, 3
CONTENDER, REFERENCES = "hier_bsp", ("ddp", "post_local_sgd")
TIME_TARGET, ACC_POINTS = 1.3, 1.0  # ddp / hier_bsp time to target (straggler); |val_acc diff| (even)
RERUN_NOTE = "    other processes used {:.2f} cores: running it again"
POST_LOCAL_NOTE = (
    "post_local_sgd as specified is not post-local SGD on gloo/CPU: Lightning's DDPStrategy registers "
    "ddp_comm_hook only when root_device is CUDA (on CPU it silently trains as plain ddp plus model "
    "averaging), and PostLocalSGDState(subgroup=None) makes the hook call dist.new_subgroups(), which raises "
    "'Default group size only takes effect when CUDA is available' on CPU. So the worker registers the hook "
    "itself, with subgroups of --local-sgd-group ranks (dist.new_subgroups(group_size=...))."
)
OPTIONS = """
--scenarios        str    straggler,even  comma-separated: straggler (rank 3 at half speed), even
--contenders       str    hier_bsp,ddp,post_local_sgd  comma-separated: which of the three to run
--target-acc       float  0.90  train until val_acc (checked every epoch) reaches this ...
--max-epochs       int    20    ... or for this many epochs
--even-epochs      int    8     the even scenario trains exactly this many epochs (final val_acc compared)
--batch-size       int    32    per process
--seed             int    42    model initialization (the same for every contender)
--hidden           int    128   MLP width
--lr               float  0.05  SGD learning rate (every contender)
--momentum         float  0.9   SGD momentum (every contender)
--superstep-steps  int    1     hier_bsp: superstep, a step count (0: use --superstep-seconds)
--superstep-seconds float 0     hier_bsp: superstep, a duration in seconds (with --superstep-steps 0)
--max-staleness    int    1     hier_bsp: max_staleness
--fill-idle        int    0     hier_bsp: fill_idle (extra micro-steps; needs --max-staleness 0)
--gradient-average str    folded  hier_bsp: gradient_average (folded or nominal)
--devices-per-node int    0     hier_bsp: devices_per_node (0: the processes per host, one node of 4)
--start-local-sgd  int    8     post_local_sgd: start_localSGD_iter (steps of global gradient all-reduce)
--averaging-period int    4     post_local_sgd: model_averaging_period
--local-sgd-group  int    1     post_local_sgd: ranks per gradient all-reduce subgroup after that
--figure           path   "{figure}"  accuracy against wall time, a panel per scenario
"""


@dataclass
class Run:
    """A contender in a scenario; per epoch: seconds since training started, val_acc, samples (all ranks)."""

    contender: str
    scenario: str
    ok: bool = True
    error: str = ""
    epochs: list[dict[str, float]] = field(default_factory=list)
    other_cores: float = 0.0
    attempts: int = 1
    first_step_s: float = 0.0  # rank 0's first training step (one-off warm-up included)

    def reached(self, target: float) -> dict[str, float] | None:
        """The first epoch (``epoch`` counted from 1) at or above ``target``, or None."""
        hits = [{**e, "epoch": i + 1} for i, e in enumerate(self.epochs) if e["val_acc"] >= target]
        return hits[0] if hits else None

    def acc_at(self, samples: float) -> float:
        """val_acc after ``samples`` samples, linear between epochs (clamped to the first and last)."""
        points = [(e["samples"], e["val_acc"]) for e in self.epochs]
        for (s0, a0), (s1, a1) in zip(points, points[1:]):
            if s0 <= samples <= s1:
                return a0 + (a1 - a0) * (samples - s0) / max(s1 - s0, 1)
        return points[0][1] if samples < points[0][0] else points[-1][1]


def run_once(args: argparse.Namespace, contender: str, scenario: str, attempt: int) -> Run:
    """One job; rank 0's times and val_acc, the samples of all ranks."""
    names = ("target_acc", "max_epochs", "batch_size", "seed", "hidden", "lr", "momentum", "superstep_steps")
    config = jobs.pick(args, *names, "superstep_seconds", "max_staleness", "start_local_sgd")
    config.update(jobs.pick(args, "averaging_period", "local_sgd_group", "fill_idle", "gradient_average"))
    config["devices_per_node"] = args.devices_per_node
    straggler = STRAGGLER_RANK if scenario == "straggler" else None
    config.update(contender=contender, straggler=straggler, hang_s=max(args.timeout - 30, 10))
    if scenario == "even":  # a fixed length: final accuracies after the same samples
        config.update(max_epochs=args.even_epochs, stop_at_target=False)
    else:
        config.update(stop_at_target=True)
    with jobs.job_dir(f"lhbench-bsp-{contender}-", args.keep_logs, show=True) as workdir:
        before = jobs.cpu_snapshot()
        with jobs.torchrun(NPROC, WORKER, [json.dumps(config), str(workdir)], workdir) as proc:
            try:
                code: int | str = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                code = f"timeout {args.timeout} s (stacks after {config['hang_s']} s in job.log; --keep-logs)"
        other = jobs.other_cores(before, jobs.cpu_snapshot())
        run = Run(contender, scenario, other_cores=other, attempts=attempt)
        outs = [workdir / f"rank{r}.json" for r in range(NPROC)]
        if code != 0 or not all(out.exists() for out in outs):
            run.ok, run.error = False, f"exit {code}:\n{jobs.tail(workdir / 'job.log', 120)}"
            return run
        records = [json.loads(out.read_text()) for out in outs]
    ranks = [r["epochs"] for r in records]
    run.epochs = [{**e, "samples": sum(r[i]["samples"] for r in ranks)} for i, e in enumerate(ranks[0])]
    run.first_step_s = records[0]["batch_ends"][0] if records[0]["batch_ends"] else 0.0
    return run


def summarize(runs: dict[str, Run], scenario: str, target: float) -> dict[str, Any]:
    """Per contender the table's values; hier_bsp's ratios (None where one did not reach the target)."""
    rows = {}
    for name, run in runs.items():
        hit, last = run.reached(target) or {}, run.epochs[-1]
        rows[name] = {"time_to_target_s": hit.get("time_s"), "epochs_to_target": hit.get("epoch")}
        after = hit["time_s"] - run.first_step_s if hit else None
        rows[name].update(first_step_s=run.first_step_s, after_first_step_s=after)
        rows[name].update(final_val_acc=last["val_acc"], samples_per_s=last["samples"] / last["time_s"])
        rows[name].update(samples=last["samples"], other_cores=run.other_cores)
    ratios: dict[str, Any] = {}
    for key, suffix in (("time_to_target_s", ""), ("after_first_step_s", " after first step")):
        t = {name: row[key] for name, row in rows.items()}
        for ref in REFERENCES:
            ratios[f"{ref}/{CONTENDER}{suffix}"] = (
                t[ref] / t[CONTENDER] if t.get(ref) and t.get(CONTENDER) else None
            )
    if scenario == "even" and {CONTENDER, "ddp"} <= runs.keys():
        samples = min(rows[CONTENDER]["samples"], rows["ddp"]["samples"])
        diff = 100 * (runs[CONTENDER].acc_at(samples) - runs["ddp"].acc_at(samples))
        ratios.update(acc_diff_samples=samples, acc_diff_points=diff)
    return {"rows": rows, "ratios": ratios}


def print_scenario(scenario: str, summary: dict[str, Any], target: float) -> None:
    """The scenario's table; the ratios, against the targets."""
    show = lambda v, spec, none="not reached": none if v is None else format(v, spec)
    verdict = lambda met, what: f" (target {what}: {'MET' if met else 'NOT MET'})"
    header = ["contender", f"time to {target} [s]", "first step [s]", "epochs to target", "final val_acc"]
    rows = [
        [name, show(r["time_to_target_s"], ".2f"), f"{r['first_step_s']:.2f}"]
        + [
            show(r["epochs_to_target"], "d"),
            f"{r['final_val_acc']:.3f}",
            f"{r['samples_per_s']:,.0f}",
            f"{r['other_cores']:.2f}",
        ]
        for name, r in summary["rows"].items()
    ]
    print(f"\n{scenario}:\n{report.md_table([*header, 'samples/s', 'other cores'], rows, tight_rule=False)}")
    for ref in REFERENCES:
        for suffix in ("", " after first step"):
            ratio = summary["ratios"][f"{ref}/{CONTENDER}{suffix}"]
            checked = scenario == "straggler" and ref == "ddp"
            met = verdict(ratio is not None and ratio >= TIME_TARGET, f">= {TIME_TARGET}") if checked else ""
            print(f"{ref} / {CONTENDER} time to target{suffix}: {show(ratio, '.3f', 'n/a')}{met}")
    if "acc_diff_points" in summary["ratios"]:
        diff, samples = summary["ratios"]["acc_diff_points"], summary["ratios"]["acc_diff_samples"]
        met = verdict(abs(diff) <= ACC_POINTS, f"within {ACC_POINTS:g} point")
        print(f"{CONTENDER} - ddp val_acc after the same {samples:,.0f} samples: {diff:+.2f} points{met}")


def draw(plt: Any, runs: list[Run], scenarios: list[str], target: float) -> Any:
    """val_acc against wall time, a line per contender, a panel per scenario."""
    fig, axes = plt.subplots(1, len(scenarios), figsize=(5 * len(scenarios), 3.6), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        for run in (r for r in runs if r.ok and r.scenario == scenario):
            times, accs = zip(*((e["time_s"], e["val_acc"]) for e in run.epochs))
            ax.plot(times, accs, "o-", label=run.contender)
        ax.axhline(target, color="k", linestyle="--", linewidth=0.8)
        ax.set(title=scenario, xlabel="wall time since training started [s]", ylabel="val_acc")
        ax.legend(fontsize=8)
    return fig


def main(argv: list[str] | None = None) -> None:
    """Every contender in every scenario (after --wait-idle, rerun up to --retry-busy times); report."""
    run_options = cli.RUN_OPTIONS.format(timeout=300, per="job", logs="the per-job temp dirs")
    options = OPTIONS.format(figure=jobs.RESULTS_DIR / "bsp.png")
    args = cli.parser(__doc__, options, run_options, cli.IDLE_OPTIONS.format(job="job")).parse_args(argv)
    jobs.exit_on_sigterm()
    scenarios, runs = cli.comma_list(args.scenarios), []
    print(f"{POST_LOCAL_NOTE}\n", flush=True)
    for scenario in scenarios:
        for name in cli.comma_list(args.contenders):
            print(f"[{scenario}] {name} ...", flush=True)
            job = partial(run_once, args, name, scenario)  # job(attempt)
            runs.append(jobs.run_until_quiet(job, args.retry_busy, args.wait_idle, RERUN_NOTE))
    summaries = {}
    for scenario in scenarios:
        done = {r.contender: r for r in runs if r.ok and r.scenario == scenario and r.epochs}
        summaries[scenario] = summarize(done, scenario, args.target_acc)
        print_scenario(scenario, summaries[scenario], args.target_acc)
    report.print_failures([(f"[{r.scenario}] {r.contender}", r.error) for r in runs if not r.ok])
    payload = {"config": report.config(args), "post_local_sgd_note": POST_LOCAL_NOTE, "summaries": summaries}
    json_out = args.json_out or jobs.RESULTS_DIR / "bsp.json"
    report.write_json(json_out, {**payload, "runs": [asdict(r) for r in runs]}, make_dir=True)
    print(f"\nwrote {json_out}")
    if report.save_figure(args.figure, lambda plt: draw(plt, runs, scenarios, args.target_acc), dpi=100):
        print(f"figure: {args.figure}")


if __name__ == "__main__":
    main()
