"""Node-shared host-memory segments for embedding tables and their optimizer state.

Local rank 0 of a node creates each segment as a file in ``/dev/shm`` (mode 0600, private to
the user) holding a table in the :mod:`~lightning_hier.sparse.table_file` format; the node's
other processes map the same file, so the node holds exactly one copy. Segment names carry the
user id, the creating process's pid and a random token, so:

- :func:`remove_stale_segments` (called before creating) removes segments whose creator is no
  longer alive: what a crashed or ``kill -9``-ed run left behind is gone at the next start;
- :class:`SegmentRegistry` removes this run's segments at teardown and at interpreter exit.
"""

from __future__ import annotations

import atexit
import os
import secrets
import tempfile
from pathlib import Path

import torch

from lightning_hier.sparse.table_file import create_table_file, map_table

PREFIX = "lightning_hier"


def segment_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _prefix() -> str:
    return f"{PREFIX}-{os.getuid()}-"


def new_segment_path(label: str) -> Path:
    """A fresh, run-private segment name: ``lightning_hier-<uid>-<pid>-<token>-<label>.tbl``."""
    safe = "".join(c if c.isalnum() or c in "._" else "_" for c in label)
    return segment_dir() / f"{_prefix()}{os.getpid()}-{secrets.token_hex(4)}-{safe}.tbl"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_segments(directory: Path | None = None) -> list[Path]:
    """Remove this user's segments whose creating process is dead; returns what was removed."""
    removed = []
    for path in (directory or segment_dir()).glob(f"{_prefix()}*.tbl"):
        try:
            pid = int(path.name[len(_prefix()) :].split("-", 1)[0])
        except ValueError:
            continue
        if not _pid_alive(pid):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def create_segment(path: Path, rows: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Create a zero-filled segment readable and writable by this user only, and map it."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
    create_table_file(path, rows, dim, dtype)
    return map_table(path)


class SegmentRegistry:
    """Segments this process created; removed by :meth:`remove_all` and at interpreter exit."""

    def __init__(self) -> None:
        self.paths: list[Path] = []
        atexit.register(self.remove_all)

    def track(self, path: Path) -> Path:
        self.paths.append(path)
        return path

    def remove_all(self) -> None:
        for path in self.paths:
            Path(path).unlink(missing_ok=True)
        self.paths = []


REGISTRY = SegmentRegistry()
