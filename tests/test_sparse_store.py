"""HybridEmbedding on one process: table files, the frequency rule, row-wise optimizers, lifecycle."""

from __future__ import annotations

import copy
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_hier import HybridEmbedding
from lightning_hier.sparse import shared_store
from lightning_hier.sparse.background import TableJobs
from lightning_hier.sparse.row_optim import RowOptimizer
from lightning_hier.sparse.sync import frequency_average, pack_rows, unpack_rows
from lightning_hier.sparse.table_file import HEADER_BYTES, TableFileError, map_table, read_header, save_table


def test_frequency_average_by_hand() -> None:
    # id 1 in one trainer, id 2 in two, id 3 in all three
    parts = [
        (torch.tensor([1, 3]), torch.tensor([[1.0, 1.0], [3.0, 0.0]])),
        (torch.tensor([2, 3]), torch.tensor([[2.0, 4.0], [6.0, 0.0]])),
        (torch.tensor([2, 3]), torch.tensor([[4.0, 8.0], [9.0, 3.0]])),
    ]
    ids, rows = frequency_average(parts)
    assert ids.tolist() == [1, 2, 3]
    torch.testing.assert_close(rows, torch.tensor([[1.0, 1.0], [3.0, 6.0], [6.0, 1.0]]))


@pytest.mark.parametrize("length", [0, 5])
def test_packed_rows_carry_ids_counts_and_rows_bit_for_bit(length: int) -> None:
    ids = torch.tensor([2**62 + 1, -7, 0, 3, 2**40], dtype=torch.int64)[:length]
    counts = torch.arange(length, dtype=torch.float32) + 0.5
    rows = torch.randn(length, 3, 2, dtype=torch.float64)
    packed = pack_rows([ids, counts, rows])
    assert packed.dtype == torch.uint8 and packed.shape == (length, 8 + 4 + 48)
    got = unpack_rows(packed, [ids, counts, rows])
    for mine, theirs in zip(got, (ids, counts, rows)):
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape and torch.equal(mine, theirs)


def test_table_jobs_run_in_order_without_grad_and_raise_a_jobs_error_at_the_wait() -> None:
    jobs, seen = TableJobs(), []
    gate = torch.ones(1, requires_grad=True)
    jobs.submit(lambda: seen.append(("first", torch.is_grad_enabled(), (gate * 2).requires_grad)))
    jobs.submit(lambda: seen.append("second"))
    jobs.wait()
    assert seen == [("first", False, False), "second"] and not jobs.busy

    def failing() -> None:
        raise ConnectionError("peer 3 is gone")

    jobs.submit(failing)
    jobs.submit(lambda: seen.append("after"))
    with pytest.raises(ConnectionError, match="peer 3"):
        jobs.wait()
    assert seen[-1] == "after"  # the queue went on; the error surfaced once
    jobs.submit(lambda: jobs.wait())  # a job that reads a table must not wait for itself
    jobs.close()


def test_row_wise_sgd_on_a_float32_table_equals_the_gather_update_scatter_path() -> None:
    table = torch.randn(50, 4)
    rows, grads = torch.tensor([7, 3, 41]), torch.randn(3, 4)
    expected = table.clone()
    expected[rows] = expected[rows] - 0.1 * grads
    RowOptimizer("sgd", table, {}, lr=0.1).step(rows, grads)
    torch.testing.assert_close(table, expected, rtol=0, atol=1e-7)
    half = torch.zeros(50, 4, dtype=torch.bfloat16)  # other storage dtypes round once, at the write
    RowOptimizer("sgd", half, {}, lr=0.1).step(rows, grads)
    assert torch.equal(half[rows], (-0.1 * grads).to(torch.bfloat16))


def test_a_deep_copy_reads_the_same_table_and_syncs_nothing() -> None:
    # a callback may keep a deepcopy of the LightningModule made after setup (an EMA of the weights)
    table = HybridEmbedding(20, 4, mode="sum", optimizer="adagrad", lr=0.1)
    table.attach(managed=True, jobs=TableJobs())
    clone = copy.deepcopy(nn.Sequential(table))[0]
    assert clone.weight.data_ptr() == table.weight.data_ptr()  # the node's table, not a second copy
    assert clone._jobs is None and clone._intra_group is None and not clone._managed
    ids = torch.tensor([[1, 5, 7]])
    torch.testing.assert_close(clone(ids), table(ids))
    with torch.no_grad():
        table.weight[5] += 1.0  # an update of the table is seen by the copy
    torch.testing.assert_close(clone(ids), table(ids))
    table._jobs.close()


def test_table_file_round_trip(tmp_path: Path) -> None:
    table = torch.randn(7, 3)
    save_table(tmp_path / "t.tbl", table)
    assert read_header(tmp_path / "t.tbl") == (7, 3, torch.float32)
    torch.testing.assert_close(map_table(tmp_path / "t.tbl"), table)
    with pytest.raises(
        ValueError, match=r"num_embeddings=1 but the file has 7; embedding_dim=1 but the file has 3"
    ):
        HybridEmbedding(1, 1, path=str(tmp_path / "t.tbl"))
    with pytest.raises(ValueError, match="dtype=torch.float16 but the file has torch.float32"):
        HybridEmbedding(7, 3, path=str(tmp_path / "t.tbl"), dtype=torch.float16)
    module = HybridEmbedding(path=str(tmp_path / "t.tbl"))
    assert (module.num_embeddings, module.embedding_dim) == (7, 3)
    module.export(tmp_path / "copy.tbl")
    assert (tmp_path / "copy.tbl").read_bytes() == (tmp_path / "t.tbl").read_bytes()


def _corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "magic":
        data[:8] = b"NOTATABL"
    elif how == "truncated":
        data = data[: HEADER_BYTES + 5]
    elif how == "rows":
        struct.pack_into("<Q", data, 16, 1000)
    elif how == "dtype":
        struct.pack_into("<I", data, 12, 99)
    elif how == "short_header":
        data = data[:10]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("magic", "not an embedding table file"),
        ("truncated", "the file has"),
        ("rows", "1000 rows x 3 dim"),
        ("dtype", "unknown dtype code 99"),
        ("short_header", "truncated"),
    ],
)
def test_bad_table_files_name_file_and_mismatch(tmp_path: Path, how: str, message: str) -> None:
    path = tmp_path / "bad.tbl"
    save_table(path, torch.zeros(4, 3))
    _corrupt(path, how)
    with pytest.raises(TableFileError, match=message) as info:
        HybridEmbedding(4, 3, path=str(path))
    assert str(path) in str(info.value)


@pytest.mark.parametrize("mode", [None, "sum", "mean"])
@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
def test_single_process_matches_dense_embedding(mode: str | None, kind: str) -> None:
    torch.manual_seed(0)
    hybrid = HybridEmbedding(30, 4, mode=mode, optimizer=kind, lr=0.1, seed=1)
    hybrid(torch.zeros(1, 1, dtype=torch.int64))  # creates the table
    hybrid.discard_pending()
    dense = nn.Embedding(30, 4) if mode is None else nn.EmbeddingBag(30, 4, mode=mode)
    dense.weight.data.copy_(hybrid.weight)
    optimizer = (
        torch.optim.SGD(dense.parameters(), lr=0.1)
        if kind == "sgd"
        else torch.optim.Adagrad(dense.parameters(), lr=0.1)
    )
    for _ in range(4):
        ids = torch.randint(0, 30, (5, 3))
        target = torch.randn(5, 3, 4) if mode is None else torch.randn(5, 4)
        (hybrid(ids) - target).pow(2).sum().backward()
        hybrid.sync_and_update()
        optimizer.zero_grad()
        (dense(ids) - target).pow(2).sum().backward()
        optimizer.step()
    torch.testing.assert_close(hybrid.weight, dense.weight.detach(), rtol=1e-5, atol=1e-6)


def test_row_wise_adam_equals_sparse_adam() -> None:
    torch.manual_seed(0)
    hybrid = HybridEmbedding(40, 6, optimizer="adam", lr=0.05, seed=2)
    hybrid(torch.zeros(1, dtype=torch.int64))
    hybrid.discard_pending()
    dense = nn.Embedding(40, 6, sparse=True)
    dense.weight.data.copy_(hybrid.weight)
    optimizer = torch.optim.SparseAdam(dense.parameters(), lr=0.05)
    for _ in range(5):
        ids = torch.randint(0, 40, (8,))
        target = torch.randn(8, 6)
        (hybrid(ids) - target).pow(2).sum().backward()
        hybrid.sync_and_update()
        optimizer.zero_grad()
        (dense(ids) - target).pow(2).sum().backward()
        optimizer.step()
    torch.testing.assert_close(hybrid.weight, dense.weight.detach(), rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="mode"):
        HybridEmbedding(4, 2, mode="max")
    with pytest.raises(ValueError, match="optimizer"):
        HybridEmbedding(4, 2, optimizer="lbfgs")
    with pytest.raises(IndexError, match=r"\[0, 4\)"):
        HybridEmbedding(4, 2)(torch.tensor([1, 4]))


def _populate_supported() -> bool:
    import mmap

    probe = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        probe.madvise(22)  # MADV_POPULATE_READ, Linux >= 5.14
        return True
    except (OSError, AttributeError):
        return False
    finally:
        probe.close()


@pytest.mark.skipif(not _populate_supported(), reason="a kernel without MADV_POPULATE_READ (Linux < 5.14)")
def test_a_populated_table_is_read_without_page_faults(tmp_path: Path) -> None:
    """Each process that maps a table took a minor fault at the first touch of each page (the benchmark's
    4 processes: ~200 per step and process, +0.7 ms, 8-10 ms in the first steps); populated at mapping,
    reading rows takes none. Reference: the same read of a plain mapping."""
    import resource

    path = tmp_path / "table.tbl"
    shared_store.create_segment(path, 50_000, 64, torch.float32)  # 12.8 MB, 3,125 pages
    ids = torch.randint(0, 50_000, (4000,), generator=torch.Generator().manual_seed(0))
    out = torch.ones(4000, 64)  # written once: the read below faults only on the table's pages

    def faults_reading(populate: str | None) -> int:
        table = map_table(path, populate=populate)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.index_select(table, 0, ids, out=out)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    assert (
        faults_reading(populate=None) > 100
    )  # one per page touched, or per 16 with the kernel's fault-around
    assert faults_reading(populate="read") < 10
    with pytest.raises(ValueError, match="populate"):
        map_table(path, writable=False, populate="write")


def test_segments_are_private_and_gone_once_attached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared_store, "segment_dir", lambda: tmp_path)
    created = []
    original = shared_store.create_segment

    def spy(path: Path, *args: object, **kwargs: object):  # noqa: ANN202
        tensor = original(path, *args, **kwargs)
        created.append((path, os.stat(path).st_mode & 0o777))
        populated.append(kwargs.get("populate"))
        return tensor

    populated: list[object] = []
    monkeypatch.setattr("lightning_hier.sparse.embedding.create_segment", spy)
    module = HybridEmbedding(10, 2, optimizer="adam")
    module(torch.tensor([1, 2]))
    assert len(created) == 3 and all(mode == 0o600 for _, mode in created)  # table + two Adam moments
    assert populated == [True] * 3  # prefault (the default): every page mapped at attach
    HybridEmbedding(10, 2, prefault=False)(torch.tensor([1]))
    assert populated[3:] == [False]
    assert all(path.parent == tmp_path for path, _ in created)  # so the emptiness below means something
    assert list(tmp_path.iterdir()) == []  # unlinked right after every process mapped them
    assert module.weight.abs().sum() > 0  # the mapping stays valid


_CRASHER = """
import os, signal, sys
from pathlib import Path
from lightning_hier.sparse import shared_store
shared_store.segment_dir = lambda: Path(sys.argv[1])
path = shared_store.new_segment_path("crash.weight")
shared_store.create_segment(path, 100, 4, __import__("torch").float32)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_segment_left_by_a_killed_job_is_removed_at_next_start(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", _CRASHER, str(tmp_path)], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    leftovers = list(tmp_path.glob("lightning_hier-*.tbl"))
    assert len(leftovers) == 1
    assert shared_store.remove_stale_segments(tmp_path) == []  # too young: could be another container's
    old = leftovers[0].stat().st_mtime - 2 * shared_store.STALE_AFTER_SECONDS
    os.utime(leftovers[0], (old, old))
    removed = shared_store.remove_stale_segments(tmp_path)
    assert removed == leftovers and list(tmp_path.iterdir()) == []


def test_the_sweep_keeps_live_segments_and_skips_what_it_cannot_remove(tmp_path: Path) -> None:
    prefix = f"{shared_store.PREFIX}-{os.getuid()}-"
    live = tmp_path / f"{prefix}{os.getpid()}-abcd-live.tbl"  # this very process: alive
    live.write_bytes(b"x")
    stuck = tmp_path / f"{prefix}999999999-abcd-stuck.tbl"  # a directory: unlink fails
    stuck.mkdir()
    for path in (live, stuck):
        os.utime(path, (0, 0))
    assert shared_store.remove_stale_segments(tmp_path) == []
    assert live.exists() and stuck.exists()


def test_hashed_ids_map_raw_ids_to_rows_and_train_like_a_dense_table() -> None:
    from lightning_hier.sparse.id_index import hashed_init

    raw_vocab = torch.tensor([10**12, -5, 2**62, 7, 123456789, -(2**40)], dtype=torch.int64)
    hybrid = HybridEmbedding(16, 3, mode="sum", optimizer="adagrad", lr=0.1, hashed_ids=True, seed=4)
    dense = nn.EmbeddingBag(len(raw_vocab), 3, mode="sum")
    dense.weight.data.copy_(hashed_init(raw_vocab.numpy(), 3, hybrid.init_scale, seed=4))
    optimizer = torch.optim.Adagrad(dense.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        picks = torch.randint(0, len(raw_vocab), (4, 2), generator=generator)
        target = torch.randn(4, 3, generator=generator)
        (hybrid(raw_vocab[picks]) - target).pow(2).sum().backward()
        hybrid.sync_and_update()
        optimizer.zero_grad()
        (dense(picks) - target).pow(2).sum().backward()
        optimizer.step()
    rows = torch.from_numpy(hybrid.index.lookup(raw_vocab.numpy()))
    seen = rows >= 0
    assert seen.sum() >= 4 and len(set(rows[seen].tolist())) == int(seen.sum())  # distinct rows
    torch.testing.assert_close(hybrid.weight[rows[seen]], dense.weight.detach()[seen], rtol=1e-5, atol=1e-6)


def test_hashed_table_full_is_a_clear_error() -> None:
    from lightning_hier.sparse.id_index import TableFullError

    hybrid = HybridEmbedding(3, 2, hashed_ids=True)
    hybrid(torch.tensor([11, 22, 33]))
    with pytest.raises(TableFullError, match="all 3 rows"):
        hybrid(torch.tensor([44]))


def test_a_table_that_does_not_fit_in_shared_memory_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shared_store, "segment_dir", lambda: tmp_path)

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")  # what a 64 MiB /dev/shm answers

    monkeypatch.setattr(os, "posix_fallocate", full)
    module = HybridEmbedding(1000, 64)
    with pytest.raises(shared_store.SharedMemoryFullError, match=r"cannot reserve 0\.2 MiB .* MiB free"):
        module(torch.tensor([1]))
    assert list(tmp_path.iterdir()) == []  # nothing half-made is left behind


def _trained_table(seed: int) -> HybridEmbedding:
    module = HybridEmbedding(6, 2, seed=seed)
    module(torch.tensor([0, 1])).sum().backward()
    module.sync_and_update()
    return module


def test_table_checkpoints_are_atomic_and_tied_to_their_checkpoint(tmp_path: Path) -> None:
    from lightning_hier.sparse.checkpoint import restore_tables, save_tables, tables_dir

    ckpt = tmp_path / "last.ckpt"
    first = _trained_table(seed=1)
    record = save_tables([("emb", first)], ckpt, write=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt.tables"]  # no temporary left
    target = HybridEmbedding(6, 2, seed=9)
    target.attach()
    restore_tables([("emb", target)], record, str(ckpt))
    torch.testing.assert_close(target.weight, first.weight)
    # a later save whose .ckpt never got written (a crash in between): the old record must not load it
    save_tables([("emb", _trained_table(seed=2))], ckpt, write=True)
    with pytest.raises(RuntimeError, match="do not belong to this checkpoint"):
        restore_tables([("emb", target)], record, str(ckpt))
    # a crash while writing leaves a temporary directory beside an intact one
    (tables_dir(ckpt).with_name("last.ckpt.tables.tmp-dead")).mkdir()
    newest = save_tables([("emb", first)], ckpt, write=True)
    restore_tables([("emb", target)], newest, str(ckpt))
    torch.testing.assert_close(target.weight, first.weight)
