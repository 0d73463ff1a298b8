"""``python -m lightning_hier.audit DIR``: check the records a run wrote to ``LIGHTNING_HIER_AUDIT_DIR``."""

from __future__ import annotations

import sys

from lightning_hier.audit.analysis import analyze


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m lightning_hier.audit DIR", file=sys.stderr)
        return 2
    report = analyze(argv[0])
    print(report.summary())
    for problem in report.problems:
        print(" -", problem)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
