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
import shutil
import tempfile
import time
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


STALE_AFTER_SECONDS = 60.0
"""A live job's segment exists only while its node attaches (its name is removed once every process
has mapped it), so a segment this old is a crashed job's; younger ones may belong to a job in
another PID namespace (another container on the node), where its creator's pid is invisible."""


def remove_stale_segments(directory: Path | None = None, min_age: float | None = None) -> list[Path]:
    """Remove this user's segments left by dead jobs; returns what was removed.

    A segment goes only if this user owns it, its creating pid is not alive, and it is older than
    ``min_age`` seconds (default :data:`STALE_AFTER_SECONDS`). Anything that cannot be read or
    removed is skipped, never an error.
    """
    min_age = STALE_AFTER_SECONDS if min_age is None else min_age
    removed = []
    now = time.time()
    for path in (directory or segment_dir()).glob(f"{_prefix()}*.tbl"):
        try:
            pid = int(path.name[len(_prefix()) :].split("-", 1)[0])
            info = path.stat()
            if info.st_uid != os.getuid() or _pid_alive(pid) or now - info.st_mtime < min_age:
                continue
            path.unlink()
        except (ValueError, OSError):
            continue
        removed.append(path)
    return removed


class SharedMemoryFullError(OSError):
    """The node's shared-memory filesystem cannot hold a table (raised before anything maps it)."""


def create_segment(
    path: Path, rows: int, dim: int, dtype: torch.dtype, populate: bool = False
) -> torch.Tensor:
    """Create a zero-filled segment readable and writable by this user only, reserve its space, map it
    (``populate``: every page mapped now for writing, as its creator initialises and updates it; see
    :func:`~lightning_hier.sparse.table_file.map_table`).

    The space is reserved up front (``posix_fallocate``): a ``/dev/shm`` too small for the table
    (Docker's default is 64 MiB) is a clear error here instead of a SIGBUS at the first touch of
    a row that does not fit.
    """
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
    try:
        create_table_file(path, rows, dim, dtype)
        size = path.stat().st_size
        fd = os.open(path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
    except OSError as err:
        path.unlink(missing_ok=True)
        free = shutil.disk_usage(path.parent).free
        raise SharedMemoryFullError(
            err.errno,
            f"cannot reserve {size_text(rows, dim, dtype)} in {path.parent} for an embedding table "
            f"({rows} x {dim} {dtype}): {free / 2**20:.1f} MiB free ({err.strerror}). Give the node more "
            "shared memory (e.g. docker run --shm-size=...), or use HybridEmbedding(path=...) on a disk "
            "file.",
        ) from err
    return map_table(path, populate="write" if populate else None)


def size_text(rows: int, dim: int, dtype: torch.dtype) -> str:
    nbytes = rows * dim * torch.empty((), dtype=dtype).element_size()
    return f"{nbytes / 2**20:.1f} MiB"


class SegmentRegistry:
    """Segments this process created; removed by :meth:`remove_all` and at interpreter exit."""

    def __init__(self) -> None:
        self.paths: list[Path] = []
        self._exit_registered = False

    def track(self, path: Path) -> Path:
        if not self._exit_registered:  # at the first segment, not when the package is imported
            atexit.register(self.remove_all)
            self._exit_registered = True
        self.paths.append(path)
        return path

    def remove_all(self) -> None:
        for path in self.paths:
            Path(path).unlink(missing_ok=True)
        self.paths = []


REGISTRY = SegmentRegistry()
