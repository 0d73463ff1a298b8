"""Saving and restoring ``HybridEmbedding`` tables once per checkpoint (not once per process).

Tables and their row-wise optimizer state are written by global rank 0 in the binary table
format to a directory beside the checkpoint, ``<checkpoint>.tables/``; the checkpoint itself
records the file names, each row optimizer's step count and the save's token.

Atomic and tied to its checkpoint: a save writes into a temporary directory, ends with a
``manifest.json`` holding a fresh token, and only then replaces ``<checkpoint>.tables/``; the
checkpoint records the same token. A crash while writing the tables leaves the previous directory
intact; a crash between the tables and the ``.ckpt`` leaves a token the old checkpoint does not
know, and resuming says so instead of mixing a new table with an old model. On several nodes the
directory must be on storage every node reads (rank 0 writes it; each node's local rank 0 reads).
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist
from torch import nn

from lightning_hier.partial_saves import partial_path, remove_dead_partials, replace_directory
from lightning_hier.sparse.embedding import HybridEmbedding
from lightning_hier.sparse.table_file import TableFileError, read_header, save_table

CHECKPOINT_KEY = "hybrid_embeddings"
MANIFEST = "manifest.json"


def find_hybrid_embeddings(module: nn.Module) -> list[tuple[str, HybridEmbedding]]:
    return [(name or "table", m) for name, m in module.named_modules() if isinstance(m, HybridEmbedding)]


def tables_dir(checkpoint_path: str | Path) -> Path:
    return Path(str(checkpoint_path) + ".tables")


def save_tables(modules: list[tuple[str, HybridEmbedding]], checkpoint_path: str | Path, write: bool) -> dict:
    """Write the tables (when ``write``) and return what the checkpoint should record."""
    final = tables_dir(checkpoint_path)
    token = uuid.uuid4().hex
    directory = partial_path(final)
    record: dict[str, Any] = {}
    if write:
        # the rule of checkpoint files (one process writes each partial directory), so what killed saves of
        # any checkpoint left goes at the next save; a copy set aside between the renames is no partial: it is
        # the only complete one until new tables replace it. Ours by name: left by a killed process that had
        # this pid, or by a save of this process that raised
        remove_dead_partials(final.parent)
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
    for name, module in modules:
        files = {"weight": f"{name}.weight.tbl"}
        files.update({state: f"{name}.{state}.tbl" for state in module.optimizer_state})
        if module.index is not None:
            files["index"] = f"{name}.index.npy"
        if write:
            assert module.weight is not None
            save_table(directory / files["weight"], module.weight)
            for state, tensor in module.optimizer_state.items():
                save_table(directory / files[state], tensor)
            if module.index is not None:
                np.save(directory / files["index"], np.stack(module.index.items(), axis=1))
        step = module.row_optimizer.step_count if module.row_optimizer is not None else 0
        record[name] = {"files": files, "step": step, "directory": str(final.resolve()), "token": token}
    if write:
        (directory / MANIFEST).write_text(json.dumps({"token": token}))
        replace_directory(directory, final)
    return record


def _check_token(directory: Path, entry: dict[str, Any], name: str) -> None:
    expected = entry.get("token")
    if expected is None:  # a checkpoint from before tokens
        return
    try:
        found = json.loads((directory / MANIFEST).read_text())["token"]
    except (OSError, ValueError, KeyError):
        found = None
    if found != expected:
        raise RuntimeError(
            f"the HybridEmbedding tables in {directory} do not belong to this checkpoint (table {name!r}: "
            f"saved token {expected}, found {found}). A save was probably interrupted after the tables "
            "and before the checkpoint file; resume from an earlier checkpoint whose tables are intact."
        )


def _table_files(entry: Any, name: str, checkpoint_path: str | None) -> tuple[Path, dict[str, str]]:
    """The directory and files the checkpoint's ``entry`` records for table ``name``."""
    files = entry.get("files") if isinstance(entry, dict) else None
    if not (
        isinstance(files, dict)
        and isinstance(files.get("weight"), str)
        and all(isinstance(f, str) and f and Path(f).name == f for f in files.values())
        and isinstance(entry.get("directory", ""), str)
    ):
        raise ValueError(
            f"the checkpoint {checkpoint_path} records no readable file list for HybridEmbedding {name!r}: "
            f"{entry!r}."
        )
    directory = tables_dir(checkpoint_path) if checkpoint_path else Path(entry.get("directory", ""))
    if not directory.is_dir():
        directory = Path(entry.get("directory", ""))
    return directory, {k: str(directory / v) for k, v in files.items()}


def _read_index(path: str, num_embeddings: int) -> np.ndarray:
    """The ``(id, row)`` pairs of a saved id index, after checking they number rows ``0..n-1`` once each."""
    try:
        pairs = np.load(path, mmap_mode="r", allow_pickle=False)  # mapped: a bad header cannot over-allocate
    except Exception as err:  # numpy's errors on a damaged .npy are ValueError, EOFError, OSError ...
        raise TableFileError(f"cannot read the id index {path}: {type(err).__name__}: {err}") from err
    n = pairs.shape[0] if pairs.ndim == 2 else -1
    if not (
        pairs.ndim == 2
        and pairs.shape[1] == 2
        and np.issubdtype(pairs.dtype, np.integer)
        and n <= num_embeddings
        and np.array_equal(np.sort(pairs[:, 1]), np.arange(n))
        and len(np.unique(pairs[:, 0])) == n
    ):
        raise TableFileError(
            f"{path} is not an id index of a {num_embeddings}-row table: it must hold (id, row) pairs that "
            f"number rows 0..n-1 once each with distinct ids, got shape {pairs.shape} of {pairs.dtype}."
        )
    return np.array(pairs)


def _check_tables(module: HybridEmbedding, files: dict[str, str]) -> np.ndarray | None:
    """Check every file that restoring ``module`` reads; returns the id index pairs (if restored).

    Every rank checks, before any rank reads alone (only the updater reads the optimizer state and the
    index): a damaged file is then refused by all ranks, and none waits in the node barrier for a peer
    that raised."""
    expected = (module.num_embeddings, module.embedding_dim)
    for kind, path in files.items():
        if kind == "index":
            continue
        rows, dim, _ = read_header(path)  # a TableFileError naming the file and what is wrong
        if (rows, dim) != expected:
            raise TableFileError(
                f"{path} holds a {rows}x{dim} table but this HybridEmbedding is {expected[0]}x{expected[1]} "
                "(a checkpoint of another model?)."
            )
    if "index" not in files or module.index is None:
        return None
    return _read_index(files["index"], module.num_embeddings)


def restore_tables(
    modules: list[tuple[str, HybridEmbedding]], record: dict, checkpoint_path: str | None
) -> None:
    """Copy saved tables into the live ones (updaters only), then a node barrier."""
    if not isinstance(record, dict):
        raise ValueError(f"the checkpoint {checkpoint_path} records its tables as {record!r}, not a dict.")
    for name, module in modules:
        if name not in record:
            raise KeyError(
                f"the checkpoint has no table for HybridEmbedding {name!r}; it has {sorted(record)}."
            )
        entry = record[name]
        directory, files = _table_files(entry, name, checkpoint_path)
        _check_token(directory, entry, name)
        pairs = _check_tables(module, files)
        files.pop("index", None)
        if pairs is not None and module.index is not None and module.is_updater:
            module.index.restore(pairs[:, 0], pairs[:, 1])
        module.load_rows_from(files.pop("weight"), files)
        if module.row_optimizer is not None:
            module.row_optimizer.step_count = int(entry["step"])
        group = module._intra_group
        if group is not None and dist.get_world_size(group) > 1:
            dist.barrier(group=group)


def remove_tables(checkpoint_path: str | Path) -> None:
    shutil.rmtree(tables_dir(checkpoint_path), ignore_errors=True)
