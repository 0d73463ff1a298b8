"""Checkpoint files are written beside their final name and renamed into place: a save killed mid-write leaves
nothing in TMPDIR, an earlier checkpoint of the same name whole, and no file named like a checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from lightning_hier.strategies.checkpoint_files import PARTIAL_MARK, SameDirectoryCheckpointIO


def _kill_mid_save(tmp_path: Path, target: Path) -> subprocess.CompletedProcess:
    """A process that saves through SameDirectoryCheckpointIO and is SIGKILLed after writing some bytes."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        import torch
        from lightning_hier.strategies.checkpoint_files import SameDirectoryCheckpointIO

        real_save = torch.save
        def save_then_die(obj, file, *args, **kwargs):
            file.write(b"half a checkpoint")
            file.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        torch.save = save_then_die
        SameDirectoryCheckpointIO().save_checkpoint({{"step": 2}}, {str(target)!r})
        """
    )
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=300)


def test_a_save_killed_mid_write_leaves_the_earlier_checkpoint_and_nothing_in_tmpdir(tmp_path: Path) -> None:
    (tmp_path / "tmp").mkdir()
    target = tmp_path / "ckpts" / "last.ckpt"
    SameDirectoryCheckpointIO().save_checkpoint({"step": 1}, target)
    killed = _kill_mid_save(tmp_path, target)
    assert killed.returncode == -9, killed.stderr.decode()
    assert list((tmp_path / "tmp").iterdir()) == []  # Lightning's fsspec save leaves a mkstemp file here
    assert torch.load(target, weights_only=True) == {"step": 1}  # the earlier checkpoint, whole
    partials = [p.name for p in target.parent.iterdir() if PARTIAL_MARK in p.name]
    assert len(partials) == 1 and not partials[0].endswith(".ckpt")  # never taken for a checkpoint
    SameDirectoryCheckpointIO().save_checkpoint({"step": 3}, target)  # the next save removes the dead one
    assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"]
    assert torch.load(target, weights_only=True) == {"step": 3}


def test_a_partial_file_of_a_live_process_is_kept(tmp_path: Path) -> None:
    """Another process still writing into the directory keeps its partial file."""
    live = tmp_path / f"epoch=1.ckpt{PARTIAL_MARK}{os.getppid()}"
    live.write_bytes(b"in progress")
    SameDirectoryCheckpointIO().save_checkpoint({"step": 1}, tmp_path / "epoch=2.ckpt")
    assert live.exists()
    assert torch.load(tmp_path / "epoch=2.ckpt", weights_only=True) == {"step": 1}


def test_file_urls_are_local_paths(tmp_path: Path) -> None:
    SameDirectoryCheckpointIO().save_checkpoint({"step": 1}, f"file://{tmp_path}/a/b.ckpt")
    assert torch.load(tmp_path / "a" / "b.ckpt", weights_only=True) == {"step": 1}


def test_every_strategy_saves_through_it_unless_the_user_gives_an_io() -> None:
    from lightning.pytorch.plugins import AsyncCheckpointIO, TorchCheckpointIO

    from lightning_hier import HierBSPStrategy, HierPipelineStrategy, HierSlicedStrategy

    for strategy_class in (HierSlicedStrategy, HierBSPStrategy, HierPipelineStrategy):
        assert type(strategy_class().checkpoint_io) is SameDirectoryCheckpointIO
        given = TorchCheckpointIO()
        assert strategy_class(checkpoint_io=given).checkpoint_io is given
        wrapped = strategy_class(checkpoint_io=AsyncCheckpointIO()).checkpoint_io
        assert type(wrapped.checkpoint_io) is SameDirectoryCheckpointIO  # the async wrapper around it


def test_lightnings_save_runs_with_the_path_and_storage_options_it_was_given(tmp_path: Path) -> None:
    """Code that wraps or mocks ``TorchCheckpointIO.save_checkpoint`` (Lightning's own tests do) sees the call
    it expects, and ``storage_options`` is refused as Lightning refuses it."""
    from unittest import mock

    import pytest

    target = tmp_path / "path.ckpt"
    with mock.patch(
        "lightning.fabric.plugins.io.torch_io.TorchCheckpointIO.save_checkpoint"
    ) as lightning_save:
        SameDirectoryCheckpointIO().save_checkpoint({"step": 1}, target, storage_options="options")
        lightning_save.assert_called_with(mock.ANY, target, storage_options="options")
        SameDirectoryCheckpointIO().save_checkpoint({"step": 1}, target)
        lightning_save.assert_called_with(mock.ANY, target, storage_options=None)
    with pytest.raises(TypeError, match="storage_options"):
        SameDirectoryCheckpointIO().save_checkpoint({"step": 1}, target, storage_options="options")


def test_another_threads_lightning_save_is_lightnings_own(tmp_path: Path) -> None:
    """The local write is this IO's only while its own save runs, on its own thread."""
    import threading
    from unittest import mock

    from lightning.fabric.plugins.io import torch_io
    from lightning.pytorch.plugins import TorchCheckpointIO

    SameDirectoryCheckpointIO().save_checkpoint({"step": 1}, tmp_path / "a.ckpt")  # installs the hand-over
    with mock.patch("lightning_hier.strategies.checkpoint_files._write_beside") as beside:
        TorchCheckpointIO().save_checkpoint({"step": 2}, tmp_path / "b.ckpt")  # plain Lightning: not ours
        thread = threading.Thread(
            target=TorchCheckpointIO().save_checkpoint, args=({"step": 3}, tmp_path / "c.ckpt")
        )
        thread.start()
        thread.join()
        beside.assert_not_called()
    assert torch.load(tmp_path / "b.ckpt", weights_only=True) == {"step": 2}
    assert torch.load(tmp_path / "c.ckpt", weights_only=True) == {"step": 3}
    assert getattr(torch_io._atomic_save, "_hands_local_paths_over", False)
