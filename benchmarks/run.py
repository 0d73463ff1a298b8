"""List the benchmarks, or run one: ``python benchmarks/run.py [NAME [args...]]``.

``NAME`` is a driver's name without ``bench_`` (``hier_sliced`` runs ``bench_hier_sliced.py``), with
its own options after it (``python benchmarks/run.py pipeline --quick``, ``... pipeline --help``);
``netns [RATE_MBIT]`` checks the emulated network on its own (root).
"""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def drivers() -> dict[str, Path]:
    """Every ``bench_*.py`` next to this file, by name."""
    return {path.stem.removeprefix("bench_"): path for path in sorted(HERE.glob("bench_*.py"))}


def summary(path: Path) -> str:
    """The first line of a driver's docstring (read without importing it)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.splitlines()[0] if doc else ""


def main(argv: list[str]) -> int:
    """List (no arguments), run a driver as if started as a script, or run the network self-test."""
    found = drivers()
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(__doc__)
        for name, path in found.items():
            print(f"  {name:<18} {summary(path)}")
        print(f"  {'netns':<18} the emulated network alone: 50 MiB from node 1 to node 0 (root)")
        return 0
    name, args = argv[0], argv[1:]
    if name == "netns":
        from harness.cluster import self_test

        self_test(rate_mbit=float(args[0]) if args else 200)
        return 0
    if name not in found:
        print(f"unknown benchmark {name!r}; choose from {', '.join(found)} (or netns)", file=sys.stderr)
        return 2
    sys.argv = [str(found[name]), *args]
    runpy.run_path(str(found[name]), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
