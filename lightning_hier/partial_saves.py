"""Directories written under a name no loader reads and renamed into place once complete."""

from __future__ import annotations

import shutil
from pathlib import Path

ASIDE_SUFFIX = ".old"  # <name>.old: a directory moved aside while its replacement is renamed in


def replace_directory(new: Path, final: Path) -> None:
    """Put the complete directory ``new`` at ``final`` by renames: an earlier ``final`` stays whole until it
    is moved aside to ``<final>.old``, and is removed only once ``new`` is in its place.

    A process killed between the two renames leaves no ``final``, the earlier directory at ``<final>.old``
    (its only complete copy) and ``new``. The next call keeps that copy until its own ``new`` is at ``final``;
    an aside found beside an existing ``final`` is older than it, and is removed first."""
    aside = final.with_name(final.name + ASIDE_SUFFIX)
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)  # a directory is renamed only onto an empty one
        final.rename(aside)
    new.rename(final)
    shutil.rmtree(aside, ignore_errors=True)
