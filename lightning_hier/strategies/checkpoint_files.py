"""Checkpoint files written beside their final name and renamed into place, so a save cut short leaves
nothing in the temporary directory and never a file that looks like a checkpoint."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_hier.partial_saves import PARTIAL_MARK, partial_path, remove_dead_partials
from lightning_hier.strategies.lightning_patches import local_checkpoint_writes

__all__ = ["PARTIAL_MARK", "SameDirectoryCheckpointIO"]


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
        # Lightning's save (its storage_options check, the directory) with the local write made here
        with local_checkpoint_writes(_write_beside):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)


def _write_beside(checkpoint: dict[str, Any], local_path: str) -> None:
    """``checkpoint`` to ``<local_path>.partial-<pid>``, flushed and renamed onto ``local_path``; partial
    files of processes no longer alive in that directory are removed first. Lightning's save has made the
    directory."""
    final = Path(local_path)
    remove_dead_partials(final.parent)
    partial = partial_path(final)
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
