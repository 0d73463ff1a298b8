"""Checkpoint files written beside their final name and renamed into place, so a save cut short leaves
nothing in the temporary directory and never a file that looks like a checkpoint."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

PARTIAL_MARK = ".partial-"  # <name>.partial-<pid>: a save in progress, or cut short by a killed process


class SameDirectoryCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with local saves made atomic inside the checkpoint's own directory.

    Lightning's own atomic save goes through an fsspec transaction, whose local file is a
    ``tempfile.mkstemp()`` in ``TMPDIR``: a process killed mid-write leaves it there for good. Here the bytes
    go to ``<path>.partial-<pid>`` next to ``path``, are flushed to disk and renamed onto ``path`` (atomic on
    POSIX), so an interrupted save leaves an earlier ``path`` (``last.ckpt``) whole and no ``.ckpt`` file
    that is not complete. Partial files of processes no longer alive are removed at the next save into the
    directory. Remote paths (``s3://``, ...) keep Lightning's path."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        fs, local_path = fsspec.core.url_to_fs(str(path))
        if not isinstance(fs, LocalFileSystem) or storage_options is not None:
            super().save_checkpoint(checkpoint, path, storage_options)  # Lightning refuses storage_options
            return
        final = Path(local_path)
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_dead_partials(final.parent)
        partial = final.with_name(f"{final.name}{PARTIAL_MARK}{os.getpid()}")
        try:
            with open(partial, "wb") as file:
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(partial, final)
        except BaseException:
            with contextlib.suppress(OSError):
                partial.unlink()
            raise


def remove_dead_partials(directory: Path) -> None:
    """Remove ``<name>.partial-<pid>`` files in ``directory`` whose process is no longer alive (a save that
    was killed); a process still writing keeps its file."""
    for candidate in directory.glob(f"*{PARTIAL_MARK}*"):
        pid_text = candidate.name.rsplit(PARTIAL_MARK, 1)[-1]
        if not pid_text.isdigit() or not candidate.is_file() or _alive(int(pid_text)):
            continue
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
