"""What :class:`~lightning_hier.profiling.comm_stats.CommStats` measured, as a CSV, a table and a figure.

The CSV has one row per rank x step x kind (:data:`CSV_COLUMNS`); a step without any communication
has one row of kind ``none``. ``step_ms`` and ``compute_ms`` describe the whole step and repeat on
each of its rows. ``timed`` is 0 on the steps ``CommProfiler(time_every_n_steps=n)`` did not time (their
time columns are 0; counts and bytes are exact): the table and the figure take times from the timed
steps only. ``plan --calibrate-from`` reads this file (:func:`read_csv`).
"""

from __future__ import annotations

import csv
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from lightning_hier.profiling.comm_stats import KINDS, StepStats

CSV_COLUMNS = (
    "rank", "step", "kind", "count", "bytes", "wire_bytes", "time_ms", "exposed_ms", "hidden_ms",
    "step_ms", "compute_ms", "timed",
)  # fmt: skip
_INTS = ("rank", "step", "count", "bytes", "wire_bytes", "timed")
_OPTIONAL = {"timed": 1}  # columns a CSV of an earlier version lacks, and their value there


def _order(kind: str) -> int:
    return KINDS.index(kind) if kind in KINDS else len(KINDS)


def step_rows(steps: Iterable[StepStats], rank: int) -> list[dict[str, Any]]:
    """The CSV rows of one rank's steps."""
    rows = []
    for step in steps:
        common = {
            "rank": rank,
            "step": step.index,
            "step_ms": step.step_s * 1e3,
            "compute_ms": step.compute_s * 1e3,
            "timed": int(step.timed),
        }
        if not step.kinds:
            rows.append({**common, "kind": "none", "count": 0, "bytes": 0, "wire_bytes": 0,
                         "time_ms": 0.0, "exposed_ms": 0.0, "hidden_ms": 0.0})  # fmt: skip
        for kind in sorted(step.kinds, key=_order):
            stats = step.kinds[kind]
            rows.append({
                **common, "kind": kind, "count": stats.count, "bytes": stats.nbytes,
                "wire_bytes": stats.wire_bytes, "time_ms": stats.time_s * 1e3,
                "exposed_ms": stats.exposed_s * 1e3, "hidden_ms": stats.hidden_s * 1e3,
            })  # fmt: skip
    return rows


def write_csv(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in rows:
            row = {**_OPTIONAL, **row}
            writer.writerow({k: (f"{v:.6f}" if isinstance(v, float) else v) for k, v in row.items()})
    return path


def read_csv(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a CommProfiler CSV, numbers as ``int`` / ``float``; raises naming a missing column."""
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in CSV_COLUMNS if c not in (reader.fieldnames or []) and c not in _OPTIONAL]
        if missing:
            raise ValueError(f"{path} is not a CommProfiler CSV: it lacks the column(s) {missing}.")
        return [{k: _parse(k, v) for k, v in {**_OPTIONAL, **row}.items()} for row in reader]


def _parse(column: str, value: Any) -> Any:
    if column in _OPTIONAL and value in (None, ""):
        return _OPTIONAL[column]
    return int(value) if column in _INTS else value if column == "kind" else float(value)


def timed_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the steps whose operations were timed."""
    return [row for row in rows if row.get("timed", 1)]


_VOLUME = ("count", "bytes", "wire_bytes")
_TIMES = ("time_ms", "exposed_ms", "hidden_ms")


def per_kind(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per kind, the mean per rank and step of count and bytes (over every step) and of time, exposed and
    hidden time (over the timed steps)."""
    totals: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(_VOLUME + _TIMES, 0.0))
    for row in rows:
        if row["kind"] == "none":
            continue
        for key in _VOLUME + (_TIMES if row.get("timed", 1) else ()):
            totals[row["kind"]][key] += float(row[key])
    n = max(1, len({(r["rank"], r["step"]) for r in rows}))
    n_timed = max(1, len({(r["rank"], r["step"]) for r in timed_rows(rows)}))
    return {
        k: {key: v / (n if key in _VOLUME else n_timed) for key, v in totals[k].items()}
        for k in sorted(totals, key=_order)
    }


def per_step(rows: Sequence[dict[str, Any]]) -> list[tuple[int, float, float]]:
    """``(step, compute_ms, exposed_ms)`` per timed step, the mean over ranks."""
    seen: dict[tuple[int, int], tuple[float, float]] = {}
    for row in timed_rows(rows):
        step_ms, compute_ms = float(row["step_ms"]), float(row["compute_ms"])
        seen[(row["step"], row["rank"])] = (compute_ms, step_ms - compute_ms)
    by_step: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for (step, _), values in seen.items():
        by_step[step].append(values)
    return [
        (step, sum(v[0] for v in vals) / len(vals), sum(v[1] for v in vals) / len(vals))
        for step, vals in sorted(by_step.items())
    ]


def summary_table(rows: Sequence[dict[str, Any]]) -> str:
    """A text table: per kind, per step and rank on average, what was sent and how much was hidden."""
    steps = per_step(rows)
    ranks = sorted({r["rank"] for r in rows})
    every = len({r["step"] for r in rows})
    timed = f" (times: {len(steps)} timed step(s))" if len(steps) != every else ""
    lines = [
        f"CommProfiler: {every} step(s) x {len(ranks)} rank(s){timed}; per step and rank on average",
        f"{'kind':<8} {'ops':>7} {'MB sent':>10} {'MB wire':>10} {'comm ms':>9} "
        f"{'exposed ms':>11} {'hidden %':>9}",
    ]
    for kind, v in per_kind(rows).items():
        hidden = 100.0 * v["hidden_ms"] / v["time_ms"] if v["time_ms"] > 0 else 0.0
        lines.append(
            f"{kind:<8} {v['count']:>7.1f} {v['bytes'] / 1e6:>10.4f} {v['wire_bytes'] / 1e6:>10.4f} "
            f"{v['time_ms']:>9.3f} {v['exposed_ms']:>11.3f} {hidden:>8.1f}%"
        )
    if steps:
        compute = sum(s[1] for s in steps) / len(steps)
        exposed = sum(s[2] for s in steps) / len(steps)
        share = 100.0 * exposed / (compute + exposed) if compute + exposed > 0 else 0.0
        lines.append(
            f"step: {compute + exposed:.3f} ms = compute {compute:.3f} ms "
            f"+ exposed comm {exposed:.3f} ms ({share:.1f}%)"
        )
    return "\n".join(lines)


def save_figure(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Stacked compute / exposed-communication time per step, and bytes per step per link kind (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    steps = per_step(rows)
    kinds = per_kind(rows)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7))
    x = [s[0] for s in steps]
    top.bar(x, [s[1] for s in steps], width=1.0, label="compute", color="tab:blue")
    top.bar(x, [s[2] for s in steps], width=1.0, bottom=[s[1] for s in steps], label="exposed communication",
            color="tab:red")  # fmt: skip
    top.set_xlabel("training step")
    top.set_ylabel("ms (mean over ranks)")
    top.set_title("Step time: compute and exposed communication")
    top.legend(loc="upper right")
    names = list(kinds)
    bottom.bar(names, [kinds[k]["bytes"] / 1e6 for k in names], color="tab:green", label="sent")
    bottom.bar(names, [kinds[k]["wire_bytes"] / 1e6 for k in names], color="none", edgecolor="black",
               label="ring wire bytes")  # fmt: skip
    bottom.set_ylabel("MB per step and rank")
    bottom.set_title("Bytes per link kind")
    bottom.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return path
