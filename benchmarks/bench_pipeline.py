"""hier_pipeline rebalanced vs its uniform split and torch.distributed.pipelining (benchmarks/README.md)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from harness import cli, jobs, report
from harness.report import fmt

WORKER = jobs.BENCH_DIR / "_pipeline_worker.py"
LABELS = {
    "single": "one process, no pipeline (Lightning)",
    "uniform": "hier_pipeline, uniform split",
    "rebalanced": "hier_pipeline, rebalanced",
    "rebalanced_split": "hier_pipeline, rebalanced, split backward (split_backward=True)",
    "pipelining": "torch pipelining, uniform split",
    "pipelining_hier_split": "torch pipelining, hier's final split",
}
CONTENDER, REFERENCE = "rebalanced", "uniform"
TARGET_SPEEDUP, TARGET_MAX_MEAN = 1.5, 1.15  # for one stage per core
# targets against one process, against torch's stages on the same split, engine overhead [ms per micro-batch]
TARGET_VS_SINGLE, TARGET_VS_TORCH, TARGET_OVERHEAD_MS = 1.4, 1.0, 0.5
BLOCKS, CORES, NAN = 16, os.cpu_count() or 1, float("nan")
QUICK = {"stages": "2", "steps": 8, "warmup": 3, "repeats": 1, "rebalance_every": 4, "max_settle_steps": 24}
# what an option left out (None) means, by --model
DEFAULTS = {
    "mlp": {"steps": 12, "warmup": 4, "max_settle_steps": 40, "micro_batches": 16, "batch_size": 1024},
    "gpt2": {"steps": 8, "warmup": 2, "max_settle_steps": 12, "micro_batches": 8, "batch_size": 32},
}
OPTIONS = """
--stages           str  2,4   comma-separated numbers of stage processes
--steps            int  None  measured steps per job (12, gpt2: 8)
--warmup           int  None  steps before the window (uniform, pipelining; 4, gpt2: 2)
--rebalance-every  int  4     rebalanced: check every N steps
--max-settle-steps int  None  rebalanced: start measuring by then (40, gpt2: 12)
--micro-batches    int  None  micro-batches per step (16, gpt2: 8)
--batch-size       int  None  samples per step (1024, gpt2: 32 sequences of 64 tokens)
--repeats          int  3     rounds: jobs per contender, interleaved; median and every round reported
--quick            flag -     smoke run: P=2 only, one round, 8 steps
--static-shapes    flag -     hier contenders: HierPipelineStrategy(static_shapes=True)
--compare-split    flag -     also run rebalanced with split_backward=True (the split's gain, in-run)
--model {heavy-first,narrow-first,gpt2} heavy-first MLP stacks (README) or a 4-block GPT-2
"""


@dataclass
class Job:
    """One torchrun job: a contender at one P in one repeat; ``worker`` is rank 0's JSON."""

    contender: str
    stages: int
    repeat: int
    attempts: int
    ok: bool = True
    error: str = ""
    wall_s: float = 0.0
    worker: dict[str, Any] = field(default_factory=dict)

    @property
    def other_cores(self) -> float:
        return self.worker.get("other_cores") or 0.0

    @property
    def samples_per_s(self) -> float:
        return self.worker["samples_per_s"] if self.ok else NAN


def median(values: list[float]) -> float:
    """Median of the values that are not nan (nan when none is)."""
    values = [v for v in values if v == v]
    return statistics.median(values) if values else NAN


def rounds_ratio(jobs_: list[Job], top: str, bottom: str) -> dict[str, Any]:
    """``top`` / ``bottom`` samples/s in each round (repeat) both ran in: the median, every round's ratio,
    the spread (max - min)."""
    rate = {(j.contender, j.repeat): j.samples_per_s for j in jobs_}
    rounds = sorted({j.repeat for j in jobs_})
    ratios = [
        rate[top, r] / rate[bottom, r] for r in rounds if (top, r) in rate and (bottom, r) in rate
    ]
    known = [v for v in ratios if v == v]
    return {
        "median": median(ratios),
        "rounds": ratios,
        "spread": max(known) - min(known) if known else NAN,
    }


def show_ratio(ratio: dict[str, Any]) -> str:
    """``1.02x [rounds 0.98, 1.02, 1.05; spread 0.07]``."""
    rounds = ", ".join(map(fmt, ratio["rounds"]))
    return f"{fmt(ratio['median'])}x [rounds {rounds}; spread {fmt(ratio['spread'])}]"


def run_job(
    args: argparse.Namespace,
    stages: int,
    repeat: int,
    contender: str,
    split: dict[str, Any] | None,
    attempt: int,
) -> Job:
    """One torchrun job (the driver waits without polling: its CPU would count as other processes')."""
    config = {
        **jobs.pick(args, "micro_batches", "batch_size", "warmup", "steps", "max_settle_steps", "model"),
        "static_shapes": args.static_shapes,
        "mode": {"uniform": "hier", "rebalanced": "hier", "rebalanced_split": "hier", "single": "single"}.get(
            contender, "pipelining"
        ),
        "rebalance": args.rebalance_every if contender.startswith("rebalanced") else "never",
        "split_backward": contender == "rebalanced_split",
        "split": split["starts"] if split else None,
        "cluster_owners": split["owners"] if split else None,
        "pin": stages <= CORES,  # rank r (all its threads) on core r mod cores
    }
    with jobs.job_dir(f"lhbench-pipe-{contender}-{stages}-", args.keep_logs, show=True) as workdir:
        t0 = time.monotonic()
        processes = 1 if contender == "single" else stages
        with jobs.torchrun(processes, WORKER, [json.dumps(config), str(workdir)], workdir) as proc:
            try:
                jobs.check_exit(proc.wait(timeout=args.timeout))
                worker = json.loads((workdir / "rank0.json").read_text())
                return Job(contender, stages, repeat, attempt, wall_s=time.monotonic() - t0, worker=worker)
            except Exception as exc:  # report and go on with the next job
                error = f"{exc}\n{jobs.tail(workdir / 'job.log')}"
                return Job(contender, stages, repeat, attempt, ok=False, error=error)


def describe(job: Job) -> str:
    """One line about a finished job: samples/s, the blocks per stage it ended with, the stage balance."""
    if not job.ok:
        return "FAILED (see below)"
    w, starts = job.worker, job.worker["final_starts"]
    split = " ".join(str(b - a) for a, b in zip(starts, [*starts[1:], w.get("num_clusters", BLOCKS)]))
    unit = "blocks" if "num_clusters" not in w or w.get("cluster_owners") is None else "clusters"
    owners = w.get("cluster_owners")
    if owners and len(starts) > 1:
        split += f" (stage 1 from {owners[starts[1]]})"
    text = (
        f"{job.samples_per_s:,.0f} samples/s, {unit} per stage {split}, stage max/mean "
        f"{fmt(w.get('max_mean_after', NAN))}, other processes {job.other_cores:.2f} cores, "
        f"job {job.wall_s:.0f} s"
    )
    if "engine_overhead_ms_per_micro_batch" in w:
        text += (
            f", engine overhead {fmt(w['engine_overhead_ms_per_micro_batch'])} ms per micro-batch "
            f"({fmt(w['engine_overhead_without_optimizer_ms_per_micro_batch'])} without the optimizer step)"
            f", extra warm-up forwards {w.get('extra_warmup', [])}"
        )
        for part in w["step_parts_ms_by_stage"]:
            text += (
                f"\n      stage {part['stage']} per step [ms]: training_step "
                f"{fmt(part['training_step'], '.1f')}, optimizer step "
                f"{fmt(part['optimizer_step'], '.1f')}, between steps {fmt(part['between_steps'], '.1f')}"
            )
            inside = part.get("per_micro_batch")
            if inside:
                text += (
                    f"; per micro-batch: engine step {fmt(inside['engine_step'], '.2f')} = waiting "
                    f"{fmt(inside['waiting'], '.2f')} + layers {fmt(inside['layers'], '.2f')} + the engine's "
                    f"own {fmt(inside['engine_own'], '.2f')}"
                )
    if job.contender == CONTENDER:
        settled = "" if w["settled"] else " (NOT settled)"
        text += f", {len(w['history'])} rebalance(s), window from step {w['window_start_step']}{settled}"
    return text


def run_setup(args: argparse.Namespace, stages: int, repeat: int, done: list[Job]) -> None:
    """One repeat of every contender at one P; the torch contenders get the splits hier ended with."""
    uniform = [round(s * BLOCKS / stages) for s in range(stages)]  # what partition="uniform" gives
    splits: dict[str, Any] = {"pipelining": {"starts": uniform, "owners": None}}
    splits["pipelining_hier_split"] = None
    for contender, name in LABELS.items():
        if contender == "single" and stages != int(cli.comma_list(args.stages)[0]):
            continue  # one process: the same at every P
        if contender == "rebalanced_split" and not args.compare_split:
            continue
        if contender == "pipelining_hier_split" and splits[contender] is None:
            print(f"[P={stages}] {name}: skipped (no rebalanced split)")
            continue
        print(f"[P={stages}, run {repeat + 1}] {name} ...", flush=True)
        run = partial(run_job, args, stages, repeat, contender, splits.get(contender))
        note = "    disturbed: other processes used {:.2f} cores"
        job = jobs.run_until_quiet(run, args.retry_busy, args.wait_idle, note, note_last=True)
        print(f"    {describe(job)}", flush=True)
        done.append(job)
        split = {"starts": job.worker.get("final_starts"), "owners": job.worker.get("cluster_owners")}
        if job.ok and contender == "uniform":  # the split hier_pipeline chose
            splits["pipelining"] = split
        elif job.ok and contender == "rebalanced":  # the split it ended with
            splits["pipelining_hier_split"] = split


# ---------------------------------------------------------------------- report
def verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def summary(stages: int, done: list[Job], all_jobs: list[Job], batch_size: int) -> dict[str, Any]:
    """One P: median samples/s, every ratio's median over the rounds (each round's ratio, the spread), the
    stage balance and migration pause, the targets (``verdict``)."""
    rate = {c: median([j.samples_per_s for j in done if j.contender == c]) for c in LABELS}
    reb = [j.worker for j in done if j.ok and j.contender == CONTENDER]
    after = median([w["max_mean_after"] for w in reb])
    waits = ": stage times include waiting for a core" if stages > CORES else ""
    label = f"{stages} stages on {CORES} cores{waits}"
    losses = sorted({f"{j.worker['first_loss']:.6f}" for j in done if j.ok})
    same = "the same in every job" if len(losses) == 1 else "DIFFERS between jobs"
    # one process runs at the first P of each round only: its rounds pair with every P's
    with_single = done + [j for j in all_jobs if j.contender == "single" and j not in done]
    ratios = {
        "rebalanced_vs_uniform": rounds_ratio(done, CONTENDER, REFERENCE),
        "rebalanced_vs_pipelining": rounds_ratio(done, CONTENDER, "pipelining"),
        "rebalanced_vs_pipelining_same_split": rounds_ratio(done, CONTENDER, "pipelining_hier_split"),
        "rebalanced_vs_single": rounds_ratio(with_single, CONTENDER, "single"),
        "pipelining_same_split_vs_single": rounds_ratio(with_single, "pipelining_hier_split", "single"),
        "split_vs_plain_backward": rounds_ratio(done, "rebalanced_split", CONTENDER),
    }
    speedup = ratios["rebalanced_vs_uniform"]["median"]
    vs_single = ratios["rebalanced_vs_single"]["median"]
    vs_torch = ratios["rebalanced_vs_pipelining_same_split"]["median"]
    split_line = (
        f"\n  split backward: the same rebalanced job with split_backward=True / {CONTENDER} = "
        f"{show_ratio(ratios['split_vs_plain_backward'])}"
        if ratios["split_vs_plain_backward"]["rounds"]
        else ""
    )
    single = median([j.samples_per_s for j in all_jobs if j.contender == "single"])
    overhead = median([w["engine_overhead_ms_per_micro_batch"] for w in reb])
    own = median([w.get("engine_own_ms_per_micro_batch", NAN) for w in reb])
    net = median([w["engine_overhead_without_optimizer_ms_per_micro_batch"] for w in reb])
    # what these stage times allow against one process, whatever the engine does (against the 1.4x target)
    single_step_s = batch_size / single
    bound = median([single_step_s / w["ideal_step_s"] for w in reb])
    floor = median([single_step_s / (w["ideal_step_s"] + w["first_stage_boundary_s"]) for w in reb])
    balanced = median([single_step_s / w["balanced_ideal_step_s"] for w in reb])
    note = "" if stages <= CORES else " (the targets are for one stage per core)"
    text = (
        f"{label}: median samples/s "
        + ", ".join(f"{c} {fmt(r, ',.0f')}" for c, r in rate.items())
        + f"\n  {CONTENDER} / {REFERENCE} = {show_ratio(ratios['rebalanced_vs_uniform'])} "
        f"(target >= {TARGET_SPEEDUP}: {verdict(speedup >= TARGET_SPEEDUP)}), "
        f"/ pipelining = {show_ratio(ratios['rebalanced_vs_pipelining'])}; stage max/mean "
        f"{fmt(median([w['max_mean_before'] for w in reb]))} -> {fmt(after)} "
        f"(target <= {TARGET_MAX_MEAN}: {verdict(after <= TARGET_MAX_MEAN)}); "
        f"migration pause {fmt(median([w['pause_s'] * 1e3 for w in reb]), '.0f')} ms{note}"
        f"\n  first-step loss {', '.join(losses)} ({same}: same weights and data)"
        f"{split_line}"
        f"\n  targets: {CONTENDER} / single process = {show_ratio(ratios['rebalanced_vs_single'])} "
        f"(target >= {TARGET_VS_SINGLE}: {verdict(vs_single >= TARGET_VS_SINGLE)}), / torch pipelining on "
        f"its split = {show_ratio(ratios['rebalanced_vs_pipelining_same_split'])} (target >= "
        f"{TARGET_VS_TORCH}: {verdict(vs_torch >= TARGET_VS_TORCH)}); torch pipelining on that split / "
        f"single process = {show_ratio(ratios['pipelining_same_split_vs_single'])}"
        f"\n  engine overhead {fmt(overhead)} ms per micro-batch (the step against (micro-batches - 1) x the "
        f"slowest stage's own layer time + every stage's, over micro-batches; target <= "
        f"{TARGET_OVERHEAD_MS}: {verdict(overhead <= TARGET_OVERHEAD_MS)}); {fmt(net)} ms without the "
        "slowest stage's optimizer step (the model's work: one process pays it too)"
        f"\n  the engine's own work per micro-batch on its busiest stage (its step less the time blocked "
        f"on a neighbour and its layers' own times): {fmt(own)} ms (target <= {TARGET_OVERHEAD_MS}: "
        f"{verdict(own <= TARGET_OVERHEAD_MS)})"
        f"\n  the most a pipeline of the rebalanced stages' own layer times could reach against one process "
        f"(no engine, no messages): {fmt(bound)}x with a free step boundary, {fmt(floor)}x with the first "
        f"stage's optimizer step and Lightning's loop between its last backward and next forward (on every "
        f"step's critical path); {fmt(balanced)}x with the same layer times split perfectly evenly"
    )
    return {
        "stages": stages,
        "label": label,
        "samples_per_s": rate,
        **{name: ratio["median"] for name, ratio in ratios.items()},
        "ratios": ratios,
        "engine_overhead_ms_per_micro_batch": overhead,
        "engine_overhead_without_optimizer_ms_per_micro_batch": net,
        "engine_own_ms_per_micro_batch": own,
        "bound_vs_single": bound,
        "bound_with_boundary_vs_single": floor,
        "balanced_bound_vs_single": balanced,
        "verdict": text,
    }


def draw(plt: Any, summaries: list[dict[str, Any]], done: list[Job]) -> Any:
    """Samples/s of every contender by P; per P the first rebalanced job's stage times before and after."""
    fig, axes = plt.subplots(1, 1 + len(summaries), figsize=(5 + 3.6 * len(summaries), 3.8), squeeze=False)
    ax, width = axes[0][0], 0.8 / len(LABELS)
    for k, (c, name) in enumerate(LABELS.items()):
        xs = [i + (k - (len(LABELS) - 1) / 2) * width for i in range(len(summaries))]
        bars = ax.bar(xs, [s["samples_per_s"][c] for s in summaries], width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=6)
    ticks = [f"P={s['stages']}" + ("\n(waits for a core)" if s["stages"] > CORES else "") for s in summaries]
    ax.set(xticks=range(len(summaries)), xticklabels=ticks, ymargin=0.45, ylabel="samples/s")
    ax.set_title(f"throughput ({CORES} cores)")
    ax.legend(fontsize=7, loc="upper left")
    for ax, s in zip(axes[0][1:], summaries):
        reb = [j.worker for j in done if j.ok and j.contender == CONTENDER and j.stages == s["stages"]]
        ax.set_visible(bool(reb and reb[0]["history"]))
        if ax.get_visible():
            xs = range(s["stages"])
            before, after = reb[0]["history"][0]["stage_times"], reb[0]["stage_times_s"]
            ax.bar([x - 0.2 for x in xs], [t * 1e3 for t in before], 0.4, label="uniform split")
            ax.bar([x + 0.2 for x in xs], [t * 1e3 for t in after], 0.4, label="rebalanced")
            ax.set(xticks=list(xs), xlabel="stage", ylabel="ms per micro-batch")
            waits = "\n(include waiting for a core)" if s["stages"] > CORES else ""
            ax.set_title(f"stage times, {s['stages']} stages on {CORES} cores{waits}", fontsize=9)
            ax.legend(fontsize=7)
    return fig


def main(argv: list[str] | None = None) -> int:
    """Run every repeat of every setup, report (also after Ctrl-C), write JSON and the figure; exit code."""
    logs = "each job's temp dir (/tmp/lhbench-pipe-*)"
    run_options = cli.RUN_OPTIONS.format(timeout=300, per="job", logs=logs)
    args = cli.parser(__doc__, OPTIONS, cli.IDLE_OPTIONS.format(job="job"), run_options).parse_args(argv)
    for name, value in DEFAULTS["gpt2" if args.model == "gpt2" else "mlp"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.quick:
        vars(args).update(QUICK)
    args.json_out = args.json_out or jobs.RESULTS_DIR / "bench_pipeline.json"
    stage_counts, done, interrupted = [int(p) for p in cli.comma_list(args.stages)], [], False
    try:
        for repeat in range(args.repeats):
            for stages in stage_counts:
                run_setup(args, stages, repeat, done)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: reporting what ran", flush=True)
    summaries = [summary(p, [j for j in done if j.stages == p], done, args.batch_size) for p in stage_counts]
    print("\n" + "\n".join(s["verdict"] for s in summaries))
    report.print_failures([(f"P={j.stages} {j.contender}", j.error) for j in done if not j.ok])
    host = {"cores": CORES, "platform": platform.platform(), "python": platform.python_version()}
    payload = {"config": report.config(args), "host": host, "setups": summaries}
    report.write_json(args.json_out, {**payload, "jobs": [asdict(j) for j in done]}, make_dir=True)
    figure = args.json_out.with_suffix(".png")
    drawn = report.save_figure(figure, lambda plt: draw(plt, summaries, done), dpi=110)
    figure_note = f" and {figure}" if drawn else " (no figure: pip install matplotlib)"
    print(f"\nwrote {args.json_out}{figure_note}")
    return 1 if interrupted or not all(j.ok for j in done) else 0


if __name__ == "__main__":
    sys.exit(main())
