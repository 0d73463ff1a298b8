"""Directories renamed into place once complete: an earlier checkpoint stays whole, a copy set aside by a
process killed between the two renames survives until a new one is in its place, and what a killed table
save left goes at the next save into the directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_hier.partial_saves import PARTIAL_MARK, replace_directory
from lightning_hier.sparse import HybridEmbedding
from lightning_hier.strategies.checkpoint_files import SameDirectoryCheckpointIO


def _directory(path: Path, content: str) -> Path:
    path.mkdir()
    (path / "data").write_text(content)
    return path


def _listing(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def test_replace_directory_puts_new_in_place_and_removes_the_earlier(tmp_path: Path) -> None:
    final = _directory(tmp_path / "last.ckpt", "earlier")
    replace_directory(_directory(tmp_path / "new", "newer"), final)
    assert _listing(tmp_path) == {"last.ckpt/data": "newer"}


def test_replace_directory_without_an_earlier_one(tmp_path: Path) -> None:
    replace_directory(_directory(tmp_path / "new", "first"), tmp_path / "last.ckpt")
    assert _listing(tmp_path) == {"last.ckpt/data": "first"}


def test_what_a_kill_between_the_renames_left_is_replaced_by_the_next_call(tmp_path: Path) -> None:
    """Killed between the renames: no ``final``, the earlier directory at ``<final>.old``, the new one where
    it was written. The next call puts its own at ``final`` and only then removes the aside."""
    final = tmp_path / "last.ckpt"
    _directory(tmp_path / "last.ckpt.old", "earlier")
    _directory(tmp_path / "killed", "never renamed in")
    replace_directory(_directory(tmp_path / "new", "newer"), final)
    assert _listing(tmp_path) == {"killed/data": "never renamed in", "last.ckpt/data": "newer"}


def test_an_aside_beside_a_final_directory_is_older_and_removed(tmp_path: Path) -> None:
    """Killed after the second rename: the aside is older than ``final``, which the next call moves aside."""
    final = _directory(tmp_path / "last.ckpt", "middle")
    _directory(tmp_path / "last.ckpt.old", "earliest")
    replace_directory(_directory(tmp_path / "new", "newest"), final)
    assert _listing(tmp_path) == {"last.ckpt/data": "newest"}


def _trained_table(seed: int) -> HybridEmbedding:
    module = HybridEmbedding(6, 2, seed=seed)
    module(torch.tensor([0, 1])).sum().backward()
    module.sync_and_update()
    return module


def _tokens(root: Path) -> dict[str, str]:
    """The save token of every table directory under ``root`` (complete ones end with the manifest)."""
    return {
        str(p.parent.relative_to(root)): json.loads(p.read_text())["token"]
        for p in root.rglob("manifest.json")
    }


def test_tables_set_aside_by_a_killed_save_outlive_the_next_failed_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table save killed between its renames leaves the earlier tables only at the aside name; a following
    save that fails while writing must not remove them before new tables are in place."""
    from lightning_hier.sparse import checkpoint
    from lightning_hier.sparse.checkpoint import save_tables, tables_dir

    ckpt = tmp_path / "last.ckpt"
    final = tables_dir(ckpt)
    first = save_tables([("emb", _trained_table(seed=1))], ckpt, write=True)["emb"]["token"]
    real_rename = Path.rename

    def killed_before_the_second_rename(self: Path, target: Path) -> Path:
        if Path(target) == final:
            raise OSError("killed between the renames")
        return real_rename(self, target)

    with monkeypatch.context() as patch:
        patch.setattr(Path, "rename", killed_before_the_second_rename)
        with pytest.raises(OSError, match="between the renames"):
            save_tables([("emb", _trained_table(seed=2))], ckpt, write=True)
    assert not final.exists() and first in _tokens(tmp_path).values()

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError("no space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "save_table", disk_full)
        with pytest.raises(OSError, match="no space"):
            save_tables([("emb", _trained_table(seed=3))], ckpt, write=True)
    assert first in _tokens(tmp_path).values()  # the earlier tables, still complete

    last = save_tables([("emb", _trained_table(seed=4))], ckpt, write=True)["emb"]["token"]
    assert _tokens(tmp_path) == {"last.ckpt.tables": last}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt.tables"]  # nothing of the cut-short saves


def _kill_mid_table_save(checkpoint: Path) -> subprocess.CompletedProcess:
    """A process that saves a table checkpoint and is SIGKILLed after writing part of the first table."""
    script = textwrap.dedent(
        f"""
        import os, signal
        import torch
        from lightning_hier.sparse import HybridEmbedding
        from lightning_hier.sparse import checkpoint

        def write_then_die(path, tensor):
            open(path, "wb").write(b"half a table")
            os.kill(os.getpid(), signal.SIGKILL)

        module = HybridEmbedding(6, 2, seed=1)
        module.attach()
        checkpoint.save_table = write_then_die
        checkpoint.save_tables([("emb", module)], {str(checkpoint)!r}, write=True)
        """
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)


def test_a_killed_table_save_is_removed_at_the_next_save_into_the_directory(tmp_path: Path) -> None:
    """Tables of a checkpoint never saved again (a top-k name) go like a killed checkpoint file's partial: at
    the next save of any checkpoint into the directory, tables or file; a live process's stay."""
    from lightning_hier.sparse.checkpoint import save_tables

    killed = _kill_mid_table_save(tmp_path / "epoch=0-step=4.ckpt")
    assert killed.returncode == -9, killed.stderr.decode()
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith("epoch=0-step=4.ckpt.tables"), left
    assert not (tmp_path / "epoch=0-step=4.ckpt.tables").exists()  # never named as the tables
    live = _directory(tmp_path / f"epoch=0-step=6.ckpt.tables{PARTIAL_MARK}{os.getppid()}", "in progress")
    save_tables([("emb", _trained_table(seed=2))], tmp_path / "epoch=1-step=8.ckpt", write=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "epoch=1-step=8.ckpt.tables"]

    killed = _kill_mid_table_save(tmp_path / "epoch=2-step=12.ckpt")
    assert killed.returncode == -9, killed.stderr.decode()
    SameDirectoryCheckpointIO().save_checkpoint({"step": 16}, tmp_path / "epoch=3-step=16.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        live.name,
        "epoch=1-step=8.ckpt.tables",
        "epoch=3-step=16.ckpt",
    ]
