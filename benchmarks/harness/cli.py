"""Command lines declared as option tables, one option a line, as ``--help`` lists them.

A line is ``--name TYPE DEFAULT help``: TYPE is ``int``, ``float``, ``str``, ``path``, ``flag``
(store_true; DEFAULT is ``-``) or a choice ``{a,b}``; DEFAULT is a Python literal (``None``, ``200``,
``25.0``, ``""``), the text itself for ``str`` and choices, or ``required``; the help is the rest of the line.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path
from typing import Any

TYPES: dict[str, Any] = {"int": int, "float": float, "str": str, "path": Path}
RUN_OPTIONS = """
--json-out   path   None       write all results as JSON here
--timeout    float  {timeout}  seconds allowed per {per}
--keep-logs  flag   -          keep {logs} with worker logs
"""
IDLE_OPTIONS = """
--wait-idle float 0 before each {job}, wait up to this many seconds for other processes to leave the CPU
--retry-busy int 0 rerun a {job} (after --wait-idle) up to this many times when other processes used the CPU
"""


def add_options(p: argparse.ArgumentParser, table: str) -> None:
    """Add every option of ``table`` (see the module docstring) to ``p``, in order."""
    for line in filter(str.strip, table.splitlines()):
        name, kind, default, *text = line.split(maxsplit=3)
        options: dict[str, Any] = {"help": text[0] if text else None}
        if kind == "flag":
            options["action"] = "store_true"
        elif default == "required":
            options.update(type=TYPES.get(kind, str), required=True)
        else:
            literal = kind in ("int", "float", "path") or default[0] in "'\""
            options.update(
                type=TYPES.get(kind, str), default=ast.literal_eval(default) if literal else default
            )
        if kind.startswith("{"):
            options["choices"] = kind[1:-1].split(",")
        p.add_argument(name, **options)


def parser(doc: str | None, *tables: str) -> argparse.ArgumentParser:
    """A parser whose ``--help`` shows ``doc`` as written, with the options of ``tables``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for table in tables:
        add_options(p, table)
    return p


def comma_list(text: str) -> list[str]:
    """``"a, b,"`` -> ``["a", "b"]``."""
    return [item.strip() for item in text.split(",") if item.strip()]
