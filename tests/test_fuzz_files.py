"""Damaged, foreign and mismatched checkpoint and table files are refused with an error naming the file.

The files are written by the package itself on one process (a tiny model under ``hier_sliced``, consolidated
and sharded; ``HybridEmbedding`` tables with Adagrad state and a hashed-id index), then truncated, flipped or
zeroed at random (hypothesis), swapped for another strategy's or another layout's files. Every read either
succeeds (a flipped byte in a tensor's values is not detectable: the formats have no checksum) or raises a
``ValueError`` / ``RuntimeError`` naming the file or directory; never another exception, a crash or a hang.
The package's own loads use ``weights_only=True``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import init_gloo, run_spawned
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_hier import HierSlicedStrategy, HybridEmbedding, consolidate_sharded_checkpoint
from lightning_hier.sparse.checkpoint import restore_tables, save_tables
from lightning_hier.sparse.table_file import HEADER_BYTES, save_table
from lightning_hier.topology import Topology, forget_groups

FUZZ = settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
ROWS, DIM = 8, 3


# ---------------------------------------------------------------------- what the package writes
class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def _loader() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(16, 4, generator=generator), torch.randn(16, generator=generator)
    )
    return torch.utils.data.DataLoader(data, batch_size=4)


def _trainer(checkpoint_format: str, max_steps: int = 2) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=HierSlicedStrategy(checkpoint_format=checkpoint_format),
    )  # fmt: skip


def _trained_table(hashed: bool) -> HybridEmbedding:
    module = HybridEmbedding(ROWS, DIM, optimizer="adagrad", hashed_ids=hashed, seed=1)
    ids = torch.tensor([10**12, 7, 3]) if hashed else torch.tensor([0, 5, 7])
    module(ids).sum().backward()
    module.sync_and_update()
    return module


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A consolidated and a sharded checkpoint of a 2-step hier_sliced fit, and table checkpoints."""
    root = tmp_path_factory.mktemp("written")
    environ = dict(os.environ)  # Lightning's launch variables stay out of the later tests
    try:
        for name, checkpoint_format in (("consolidated.ckpt", "consolidated"), ("sharded.ckpt", "sharded")):
            trainer = _trainer(checkpoint_format)
            trainer.fit(Tiny(), _loader())
            trainer.save_checkpoint(root / name)
    finally:
        os.environ.clear()
        os.environ.update(environ)
        if dist.is_initialized():
            dist.destroy_process_group()
        forget_groups()
    for name, hashed in (("tables.ckpt", False), ("hashed.ckpt", True)):
        record = save_tables([("emb", _trained_table(hashed))], root / name, write=True)
        (root / f"{name}.json").write_text(json.dumps(record))
    return root


# ---------------------------------------------------------------------- damage
def _damage(path: Path, how: str, where: float, bits: int) -> None:
    data = bytearray(path.read_bytes())
    at = min(int(where * len(data)), max(len(data) - 1, 0))
    if how == "truncate":
        data = data[:at]
    elif how == "flip":
        for k in range(bits):
            i = (at + 7919 * k) % len(data)
            data[i] ^= 1 << (k % 8)
    else:  # "zero": a run of zero bytes, as a torn write leaves
        data[at : at + 64] = bytes(len(data[at : at + 64]))
    path.write_bytes(bytes(data))


DAMAGE = st.tuples(st.sampled_from(["truncate", "flip", "zero"]), st.floats(0, 1), st.integers(1, 16))


@contextmanager
def _no_hang(seconds: int = 60) -> Iterator[None]:
    """A read that blocks longer than ``seconds`` fails the test instead of hanging it."""

    def timed_out(signum: int, frame: Any) -> None:
        raise AssertionError(f"the read did not return in {seconds} s")

    previous = signal.signal(signal.SIGALRM, timed_out)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def refused_or_read(read: Callable[[], Any], *names: Path) -> Any:
    """``read()``'s result, or ``None`` where it raised a ``ValueError`` or ``RuntimeError`` naming one of
    ``names`` (the damaged file or its directory); any other outcome fails."""
    with _no_hang():
        try:
            return read()
        except (ValueError, RuntimeError) as err:
            assert any(str(name) in str(err) for name in names), (type(err).__name__, str(err)[:500])
            return None


def _copy(written: Path, name: str, to: Path) -> Path:
    target = to / name
    shutil.rmtree(target, ignore_errors=True)
    if (written / name).is_dir():
        shutil.copytree(written / name, target)
    else:
        shutil.copy(written / name, target)
    return target


# ---------------------------------------------------------------------- fuzzed
@FUZZ
@given(damage=DAMAGE)
def test_a_damaged_consolidated_checkpoint_is_read_or_refused_naming_it(
    written: Path, tmp_path: Path, damage: tuple
) -> None:
    path = _copy(written, "consolidated.ckpt", tmp_path)
    _damage(path, *damage)
    checkpoint = refused_or_read(lambda: HierSlicedStrategy().load_checkpoint(str(path)), path)
    if checkpoint is not None:
        assert isinstance(checkpoint["state_dict"], dict)


@FUZZ
@given(part=st.sampled_from(["meta.pt", "__0_0.distcp", ".metadata"]), damage=DAMAGE)
def test_a_damaged_sharded_checkpoint_is_read_or_refused_naming_it(
    written: Path, tmp_path: Path, part: str, damage: tuple
) -> None:
    directory = _copy(written, "sharded.ckpt", tmp_path)
    _damage(directory / part, *damage)
    meta = refused_or_read(
        lambda: HierSlicedStrategy(checkpoint_format="sharded").load_checkpoint(directory), directory
    )
    converted = refused_or_read(lambda: consolidate_sharded_checkpoint(directory), directory)
    if converted is not None:
        assert meta is not None
        assert set(converted["state_dict"]) >= {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}


def _restore(written: Path, name: str, directory: Path, hashed: bool) -> None:
    record = json.loads((written / f"{name}.json").read_text())
    target = HybridEmbedding(ROWS, DIM, optimizer="adagrad", hashed_ids=hashed, seed=9)
    target.attach()
    restore_tables([("emb", target)], record, str(directory.with_suffix("")))


@FUZZ
@given(
    part=st.sampled_from(["emb.weight.tbl", "emb.sum.tbl", "emb.index.npy", "manifest.json"]), damage=DAMAGE
)
def test_damaged_table_files_are_read_or_refused_naming_them(
    written: Path, tmp_path: Path, part: str, damage: tuple
) -> None:
    directory = _copy(written, "hashed.ckpt.tables", tmp_path)
    _damage(directory / part, *damage)
    refused_or_read(
        lambda: _restore(written, "hashed.ckpt", directory, hashed=True), directory / part, directory
    )


@FUZZ
@given(damage=DAMAGE)
def test_a_damaged_table_file_given_as_path_is_read_or_refused_naming_it(
    written: Path, tmp_path: Path, damage: tuple
) -> None:
    path = _copy(written / "tables.ckpt.tables", "emb.weight.tbl", tmp_path)
    _damage(path, *damage)

    def read() -> torch.Tensor:
        module = HybridEmbedding(path=str(path))
        return module(torch.tensor([0, module.num_embeddings - 1]))  # the first and the last row

    rows = refused_or_read(read, path)
    if rows is not None:
        assert rows.shape == (2, DIM)


# ---------------------------------------------------------------------- weights_only
def test_the_package_reads_its_checkpoints_with_weights_only(
    written: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Any] = []
    load = torch.load

    def recording_load(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("weights_only"))
        return load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    HierSlicedStrategy().load_checkpoint(str(written / "consolidated.ckpt"))
    HierSlicedStrategy(checkpoint_format="sharded").load_checkpoint(str(written / "sharded.ckpt"))
    consolidate_sharded_checkpoint(written / "sharded.ckpt", tmp_path / "converted.ckpt")
    assert calls and False not in calls, calls  # None is torch's default, which is weights_only=True
    monkeypatch.undo()
    assert torch.serialization._default_to_weights_only(None)  # what torch.load does without the argument
    for path in ("consolidated.ckpt", "sharded.ckpt/meta.pt"):
        assert isinstance(torch.load(written / path, weights_only=True)["state_dict"], dict)
    assert torch.load(tmp_path / "converted.ckpt", weights_only=True)["optimizer_states"]


class Payload:
    """An object a checkpoint should never unpickle unasked: unpickling runs its class's code."""


def test_a_sharded_checkpoint_holding_an_arbitrary_object_is_refused_unless_trusted(
    written: Path, tmp_path: Path
) -> None:
    directory = _copy(written, "sharded.ckpt", tmp_path)
    meta = torch.load(directory / "meta.pt", weights_only=True)
    torch.save({**meta, "payload": Payload()}, directory / "meta.pt")
    with pytest.raises(ValueError, match="Weights only load failed") as info:
        HierSlicedStrategy(checkpoint_format="sharded").load_checkpoint(str(directory))
    assert str(directory) in str(info.value)
    trusted = HierSlicedStrategy(checkpoint_format="sharded").load_checkpoint(
        str(directory), weights_only=False
    )
    assert isinstance(trusted["payload"], Payload)


# ---------------------------------------------------------------------- another strategy, another layout
def test_a_consolidated_file_given_as_a_sharded_checkpoint_is_refused_naming_it(written: Path) -> None:
    path = written / "consolidated.ckpt"
    with pytest.raises(
        ValueError, match=r"is not a sharded hier_sliced checkpoint: it has no meta\.pt"
    ) as info:
        consolidate_sharded_checkpoint(path)
    assert str(path) in str(info.value)


def test_a_sharded_directory_of_another_format_is_refused_naming_it(written: Path, tmp_path: Path) -> None:
    # meta.pt of another strategy (a plain Lightning checkpoint) beside the DCP files
    directory = _copy(written, "sharded.ckpt", tmp_path)
    shutil.copy(written / "consolidated.ckpt", directory / "meta.pt")
    for read in (
        consolidate_sharded_checkpoint,
        HierSlicedStrategy(checkpoint_format="sharded").load_checkpoint,
    ):
        with pytest.raises(ValueError, match="has no 'hier_sliced_sharded' entry") as info:
            read(directory)
        assert str(directory) in str(info.value)
    # a DCP directory without meta.pt (another tool's sharded format)
    (directory / "meta.pt").unlink()
    with pytest.raises(ValueError, match="is a directory without meta.pt") as info:
        HierSlicedStrategy().load_checkpoint(str(directory))
    assert str(directory) in str(info.value)


def _as_two_devices_per_node(directory: Path) -> None:
    """Rewrite ``meta.pt`` as if the checkpoint came from a run of 2 devices per node, but keep its files."""
    meta = torch.load(directory / "meta.pt", weights_only=True)
    layout = meta["hier_sliced_sharded"]["layout"]
    layout["devices_per_node"] = 2
    for bucket in layout["buckets"]:
        padded = bucket["padded_numel"] + bucket["padded_numel"] % 2
        bucket["padded_numel"], bucket["bounds"] = padded, [[0, padded // 2], [padded // 2, padded]]
    torch.save(meta, directory / "meta.pt")


def test_a_sharded_checkpoint_from_another_layout_is_refused_naming_it(written: Path, tmp_path: Path) -> None:
    directory = _copy(written, "sharded.ckpt", tmp_path)
    _as_two_devices_per_node(directory)
    with pytest.raises(ValueError, match="lacks slice 0 of bucket 0") as info:
        consolidate_sharded_checkpoint(directory)
    assert str(directory) in str(info.value)
    # resuming refuses it too, before any slice is read
    with pytest.raises(ValueError, match="was written with another slice layout") as info:
        _trainer("sharded", max_steps=3).fit(Tiny(), _loader(), ckpt_path=str(directory))
    assert str(directory) in str(info.value)


def test_a_truncated_slice_file_is_refused_naming_the_directory(written: Path, tmp_path: Path) -> None:
    # torch.distributed.checkpoint reports it as a CheckpointException, a BaseException
    directory = _copy(written, "sharded.ckpt", tmp_path)
    _damage(directory / "__0_0.distcp", "truncate", 0.5, 1)
    with pytest.raises(
        ValueError, match=r"cannot read the sharded checkpoint .* \(slices\), damaged"
    ) as info:
        consolidate_sharded_checkpoint(directory)
    assert str(directory) in str(info.value)
    with pytest.raises(ValueError, match=r"\((parameter|optimizer) slices\), damaged") as info:
        _trainer("sharded", max_steps=3).fit(Tiny(), _loader(), ckpt_path=str(directory))
    assert str(directory) in str(info.value)


def test_a_truncated_consolidated_checkpoint_is_refused_naming_it(written: Path, tmp_path: Path) -> None:
    path = _copy(written, "consolidated.ckpt", tmp_path)
    _damage(path, "truncate", 0.5, 1)
    with pytest.raises(RuntimeError, match="damaged, or no checkpoint") as info:
        _trainer("consolidated", max_steps=3).fit(Tiny(), _loader(), ckpt_path=str(path))
    assert str(path) in str(info.value)


def test_a_checkpoint_whose_optimizer_state_lost_its_structure_is_refused_naming_it(
    written: Path, tmp_path: Path
) -> None:
    checkpoint = torch.load(written / "consolidated.ckpt", weights_only=True)
    checkpoint["optimizer_states"][0].pop("param_groups")  # what a flipped byte in a key's name leaves
    torch.save(checkpoint, tmp_path / "bad.ckpt")
    with pytest.raises(ValueError, match="optimizer state without its 'state' and 'param_groups'") as info:
        _trainer("consolidated", max_steps=3).fit(Tiny(), _loader(), ckpt_path=str(tmp_path / "bad.ckpt"))
    assert str(tmp_path / "bad.ckpt") in str(info.value)


# ---------------------------------------------------------------------- tables of another model
def test_an_optimizer_state_table_of_another_shape_is_refused_naming_it(
    written: Path, tmp_path: Path
) -> None:
    directory = _copy(written, "tables.ckpt.tables", tmp_path)
    save_table(directory / "emb.sum.tbl", torch.ones(1, DIM))  # one row would broadcast over all of them
    with pytest.raises(
        ValueError, match=f"holds a 1x{DIM} table but this HybridEmbedding is {ROWS}x{DIM}"
    ) as info:
        _restore(written, "tables.ckpt", directory, hashed=False)
    assert str(directory / "emb.sum.tbl") in str(info.value)


@pytest.mark.parametrize(
    ("pairs", "why"),
    [
        (np.array([[10, 0], [11, 0]]), "row 0 twice"),
        (np.array([[10, 0], [10, 1]]), "an id twice"),
        (np.array([[10, 0], [11, 5]]), "a gap"),
        (np.stack([np.arange(ROWS + 1), np.arange(ROWS + 1)], axis=1), "more ids than rows"),
        (np.array([10, 0]), "not pairs"),
        (np.array([[0.5, 0.0]]), "not integers"),
    ],
)
def test_an_id_index_that_does_not_number_the_rows_is_refused_naming_it(
    written: Path, tmp_path: Path, pairs: np.ndarray, why: str
) -> None:
    directory = _copy(written, "hashed.ckpt.tables", tmp_path)
    np.save(directory / "emb.index.npy", pairs)
    with pytest.raises(ValueError, match="is not an id index of a 8-row table") as info:
        _restore(written, "hashed.ckpt", directory, hashed=True)
    assert str(directory / "emb.index.npy") in str(info.value), why


def test_a_truncated_id_index_is_refused_naming_it(written: Path, tmp_path: Path) -> None:
    directory = _copy(written, "hashed.ckpt.tables", tmp_path)
    _damage(directory / "emb.index.npy", "truncate", 0.9, 1)
    with pytest.raises(ValueError, match="cannot read the id index") as info:
        _restore(written, "hashed.ckpt", directory, hashed=True)
    assert str(directory / "emb.index.npy") in str(info.value)


def _restore_on_two_processes(rank: int, world: int, store: str, written: str, damaged: str) -> dict:
    init_gloo(rank, world, store, timeout_s=20)
    topology = Topology(world, rank, world).build_groups()
    table = HybridEmbedding(ROWS, DIM, optimizer="adagrad", hashed_ids=True, seed=9)
    table.attach(topology.intra_group, topology.inter_group, rank)
    record = json.loads((Path(written) / "hashed.ckpt.json").read_text())
    try:
        restore_tables([("emb", table)], record, str(Path(damaged).with_suffix("")))
    except Exception as err:
        return {"raised": type(err).__name__, "message": str(err)}
    return {"raised": None}


@pytest.mark.parametrize("part", ["emb.sum.tbl", "emb.index.npy"])
def test_a_damaged_file_only_the_updater_reads_is_refused_by_every_process(
    written: Path, tmp_path: Path, part: str
) -> None:
    # the optimizer state and the id index are read by local rank 0 alone; the node's other processes must
    # refuse the file as well, not wait for rank 0 in the node barrier
    directory = _copy(written, "hashed.ckpt.tables", tmp_path)
    _damage(directory / part, "truncate", 0.5, 1)
    results = run_spawned(_restore_on_two_processes, 2, tmp_path, str(written), str(directory))
    for rank, result in enumerate(results):
        assert result is not None and result["raised"] == "TableFileError", (rank, result)
        assert str(directory / part) in result["message"], (rank, result)


def test_a_table_file_is_the_header_and_the_rows_it_describes(written: Path) -> None:
    # the premise of the damage tests above: a table file's size is exact, so truncation is always seen
    path = written / "tables.ckpt.tables" / "emb.weight.tbl"
    assert path.stat().st_size == HEADER_BYTES + ROWS * DIM * 4
