"""Saves written under a name no loader reads and renamed into place once complete, and the rules by which
what a killed save left is removed.

- ``<name>.partial-<pid>``: a file or directory one process writes alone (a consolidated checkpoint,
  ``HybridEmbedding`` tables). Removed at the next save into its directory once process ``pid`` is no longer
  alive: a process still writing, or another process saving into the same directory at the same time,
  keeps its own.
- ``<name>.old``: a complete directory moved aside while its replacement is renamed in
  (:func:`replace_directory`); removed once a replacement is in place.
- ``<path>.partial``: a sharded checkpoint, which every rank writes into (``sliced/sharded_checkpoint.py``
  says why it cannot follow the pid rule).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

PARTIAL_MARK = ".partial-"  # <name>.partial-<pid>: a save in progress, or cut short by a killed process
ASIDE_SUFFIX = ".old"  # <name>.old: a directory moved aside while its replacement is renamed in


def partial_path(final: Path) -> Path:
    """``<final>.partial-<pid>``: where this process writes what it then renames to ``final``."""
    return final.with_name(f"{final.name}{PARTIAL_MARK}{os.getpid()}")


def remove_dead_partials(directory: Path) -> None:
    """Remove the ``<name>.partial-<pid>`` files and directories in ``directory`` whose process is no longer
    alive (a save that was killed); a process still writing keeps its own."""
    for candidate in directory.glob(f"*{PARTIAL_MARK}*"):
        pid_text = candidate.name.rsplit(PARTIAL_MARK, 1)[-1]
        if not pid_text.isdigit() or _alive(int(pid_text)):
            continue
        if candidate.is_dir() and not candidate.is_symlink():
            shutil.rmtree(candidate, ignore_errors=True)
        elif candidate.is_file():
            with contextlib.suppress(OSError):
                candidate.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


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
