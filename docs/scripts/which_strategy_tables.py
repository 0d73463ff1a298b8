"""The tables of docs/which_strategy.md, from the cost model (``lightning_hier.plan``).

    python docs/scripts/which_strategy_tables.py > /tmp/tables.md

and paste the output into the page. Every number is a prediction of the alpha-beta model in
``lightning_hier/plan/cost_model.py`` (formulas: docs/cost_model.md), not a measurement.
"""

from __future__ import annotations

import math

from lightning_hier.plan import Cluster, plan

DEVICES_PER_NODE = 8
NVLINK = 300e9  # bytes/s per device inside a node
LATENCY = 5e-6  # seconds per ring step (both links)
GBIT = 1e9 / 8  # bytes/s
LINKS = (100, 200, 400)  # Gbit/s per node between nodes
NODES = (2, 4, 8, 16, 32, 64, 128, 256)
MODELS = {"1B": 1e9, "7B": 7e9}  # parameters, gradients in bf16
BACKWARD = {"1B": 0.05, "7B": 0.3}  # an assumed backward time per step (seconds), for the overlap table
SUPERSTEPS = (1, 4, 16)


def cluster(nodes: int, gbit: float) -> Cluster:
    return Cluster(nodes, DEVICES_PER_NODE, NVLINK, gbit * GBIT, LATENCY)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def flat_vs_hier(model: str) -> list[str]:
    head = "| nodes (GPUs) |" + " ddp ms | hier_sliced ms | ddp / hier |" * len(LINKS)
    sub = "| --- |" + " ---: | ---: | ---: |" * len(LINKS)
    links = "| inter-node link per node → |" + "".join(f" **{g} Gb/s** | | |" for g in LINKS)
    lines = [head, sub, links]
    for n in NODES:
        cells = []
        for gbit in LINKS:
            result = plan(cluster(n, gbit), MODELS[model], "bf16")
            ddp, hier = result.by_name("ddp (flat ring)"), result.by_name("hier_sliced")
            cells.append(f" {ms(ddp.seconds)} | {ms(hier.seconds)} | {ddp.seconds / hier.seconds:.2f}× |")
        lines.append(f"| {n} ({n * DEVICES_PER_NODE}) |" + "".join(cells))
    return lines


def bytes_and_steps() -> list[str]:
    lines = [
        "| nodes | ddp bytes / node | hier_sliced bytes / node | ratio | ddp latency steps "
        "| hier_sliced latency steps | 1B: hier intra-node part ms | 7B: hier intra-node part ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n in NODES:
        c = cluster(n, 200)
        p = c.world_size
        local = c.devices_per_node
        ddp_bytes, hier_bytes = 2 * (p - 1) / p, 2 * (n - 1) / n
        intra = {
            m: 2 * (local - 1) * (LATENCY + MODELS[m] * 2 / local / NVLINK) for m in MODELS
        }  # reduce-scatter + all-gather on NVLink (cost_model.hierarchical)
        lines.append(
            f"| {n} | {ddp_bytes:.3f} S | {hier_bytes:.3f} S | {hier_bytes / ddp_bytes:.2f} | {2 * (p - 1)} "
            f"| {2 * (n - 1) + 2 * (local - 1)} | {ms(intra['1B'])} | {ms(intra['7B'])} |"
        )
    return lines


def crossover() -> list[str]:
    lines = [
        "| model | link | hier_sliced faster at (nodes) | best ddp / hier | at nodes | at 256 nodes |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for model, params in MODELS.items():
        for gbit in LINKS:
            ratios = []
            for n in NODES:
                r = plan(cluster(n, gbit), params, "bf16")
                ratios.append(r.by_name("ddp (flat ring)").seconds / r.by_name("hier_sliced").seconds)
            best = max(range(len(NODES)), key=lambda i: ratios[i])
            faster = _ranges([n for n, x in zip(NODES, ratios) if x > 1.0])
            best_cells = f"{ratios[best]:.2f}× | {NODES[best]} | {ratios[-1]:.2f}×"
            lines.append(f"| {model} | {gbit} Gb/s | {faster} | {best_cells} |")
    return lines


def _ranges(nodes: list[int]) -> str:
    """``[2, 4, 8, 256]`` -> ``"2–8, 256"`` (runs of consecutive entries of NODES)."""
    if not nodes:
        return "never"
    runs: list[list[int]] = [[nodes[0]]]
    for n in nodes[1:]:
        if NODES.index(n) == NODES.index(runs[-1][-1]) + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}–{r[-1]}" for r in runs)


def overlap(model: str) -> list[str]:
    """Time buckets: exposed = max(C - backward, C / buckets); hidden once backward >= C (1 - 1/buckets)."""
    backward = BACKWARD[model]
    head = "| nodes |" + "".join(f" {g} Gb/s: hier C ms | exposed ddp / hier ms |" for g in LINKS)
    lines = [head, "| ---: |" + " ---: | ---: |" * len(LINKS)]
    for n in (2, 8, 64, 256):
        cells = []
        for gbit in LINKS:
            r = plan(cluster(n, gbit), MODELS[model], "bf16", backward_seconds=backward)
            hier = r.by_name("hier_sliced")
            ddp_o, hier_o = r.by_name("ddp, overlapped buckets"), r.by_name("hier_sliced, time buckets")
            cells.append(
                f" {ms(hier.seconds)} | {ms(ddp_o.exposed_seconds)} / {ms(hier_o.exposed_seconds)} |"
            )
        lines.append(f"| {n} |" + "".join(cells))
    return lines


def bsp(model: str, gbit: int) -> list[str]:
    step = 1.5 * BACKWARD[model]  # the plan's default micro-step time: 1.5 x backward
    head = "| nodes | per superstep ms |" + "".join(f" exposed / micro-step, k = {k} |" for k in SUPERSTEPS)
    lines = [head + " smallest k that hides it |", "| --- | ---: |" + " ---: |" * len(SUPERSTEPS) + " ---: |"]
    for n in NODES:
        cells, per = [], 0.0
        for k in SUPERSTEPS:
            e = plan(cluster(n, gbit), MODELS[model], "bf16", superstep_steps=k, step_seconds=step).by_name(
                f"hier_bsp (superstep_steps={k})"
            )
            per = e.seconds
            cells.append(f" {ms(e.exposed_seconds)} |")
        lines.append(f"| {n} | {ms(per)} |" + "".join(cells) + f" {math.ceil(per / step)} |")
    return lines


def main() -> None:
    out: list[str] = []
    for model in MODELS:
        out += [f"### {model} parameters, bf16 gradients ({MODELS[model] * 2 / 1e9:g} GB per step)", ""]
        out += flat_vs_hier(model) + [""]
    out += ["### Where it stops helping", ""] + crossover() + [""]
    out += ["### Bytes per node and latency steps (8 GPUs per node; S = gradient bytes)", ""]
    out += bytes_and_steps() + [""]
    for model in MODELS:
        out += [f"### Time-bucketed overlap: {model}, backward {ms(BACKWARD[model])} ms per step", ""]
        out += overlap(model) + [""]
    for model in MODELS:
        out += [
            f"### hier_bsp: {model}, 200 Gb/s, micro-step {ms(1.5 * BACKWARD[model])} ms of compute",
            "",
        ]
        out += bsp(model, 200) + [""]
    print("\n".join(out).rstrip())


if __name__ == "__main__":
    main()
