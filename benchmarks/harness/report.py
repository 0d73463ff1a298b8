"""Result tables, JSON results and figures."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def text_table(header: str, rows: Sequence[str]) -> str:
    """A fixed-width table: the header, a rule as wide as the header, the rows."""
    return "\n".join([header, "-" * len(header), *rows])


def md_row(cells: Sequence[str]) -> str:
    """One markdown table row (an empty cell is ``| |``)."""
    return "|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|"


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]], tight_rule: bool = True) -> str:
    """A markdown table; the rule under the header is ``|---|---|`` or (``tight_rule=False``) ``| --- |``."""
    rule = "|" + "---|" * len(header) if tight_rule else md_row(["---"] * len(header))
    return "\n".join([md_row(header), rule, *(md_row(row) for row in rows)])


def fmt(value: float, spec: str = ".2f") -> str:
    """``value`` formatted, or ``n/a`` for nan."""
    return format(value, spec) if value == value else "n/a"


def config(args: argparse.Namespace) -> dict[str, Any]:
    """The driver's options as JSON values (paths as strings)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def write_json(path: Path, payload: dict[str, Any], make_dir: bool = False) -> None:
    """Write ``payload`` as indented JSON (values JSON cannot hold as strings)."""
    if make_dir:
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str))


def print_failures(failures: list[tuple[str, str]]) -> None:
    """``label FAILED:`` and the error of every failed run."""
    for label, error in failures:
        print(f"\n{label} FAILED:\n{error}")


def save_json(path: Path | None, payload: Callable[[], dict[str, Any]]) -> None:
    """Write ``payload()`` to ``path`` when one is given, and say so."""
    if path:
        write_json(path, payload())
        print(f"\nwrote {path}")


def save_figure(path: Path, draw: Callable[[Any], Any], dpi: int) -> bool:
    """``draw(pyplot)`` returns a matplotlib figure, saved to ``path``; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig = draw(plt)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return True
