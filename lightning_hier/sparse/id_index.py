"""A node-shared id -> row index for raw 64-bit feature ids (``HybridEmbedding(hashed_ids=True)``).

Open addressing with linear probing over ``slots`` (a power of two, at least twice the capacity)
held in one shared-memory segment: per slot the id, its row and a "used" flag, plus the count of
rows handed out. Lookups are lock-free and vectorised; inserting takes an ``flock`` on the segment
so the node's processes never hand out a row twice. A slot is published by writing its ``used``
flag last, so a concurrent reader sees either nothing (and retries under the lock) or the whole
entry.

Rows are node-local addresses; ids are the global keys (the gradient exchange uses ids), so two
nodes may give the same id different rows. A new row is initialised from a hash of its id, so
every node starts the same id from the same values.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

_MULT = np.uint64(0x9E3779B97F4A7C15)


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a well-spread 64-bit hash of each value (vectorised)."""
    x = values.astype(np.uint64) * _MULT
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def hashed_init(ids: np.ndarray, dim: int, scale: float, seed: int) -> torch.Tensor:
    """Rows uniform in ``[-scale, scale)`` determined by ``(seed, id, column)`` only."""
    with np.errstate(over="ignore"):
        keys = _mix(ids.astype(np.uint64) ^ _mix(np.array([seed], dtype=np.uint64)))
        cells = _mix(keys[:, None] + np.arange(1, dim + 1, dtype=np.uint64)[None, :])
    unit = (cells >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return torch.from_numpy((unit * 2.0 - 1.0) * scale).float()


class TableFullError(RuntimeError):
    """More distinct ids than the table has rows."""


class SharedIdIndex:
    """The id -> row map of one node; create on local rank 0, open (same path) on the others."""

    HEADER = 2  # int64 cells: rows handed out, slots

    def __init__(self, path: Path, capacity: int, create: bool) -> None:
        self.path = Path(path)
        self.capacity = capacity
        slots = 1
        while slots < 2 * capacity:
            slots *= 2
        self.slots = slots
        cells = self.HEADER + 2 * slots
        if create:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, cells * 8 + slots)
            os.close(fd)
        self._fd = os.open(self.path, os.O_RDWR)  # kept open: the lock outlives the unlinked name
        self._cells = np.memmap(self.path, dtype=np.int64, mode="r+", shape=(cells,))
        self._used = np.memmap(self.path, dtype=np.uint8, mode="r+", offset=cells * 8, shape=(slots,))
        if create:
            self._cells[1] = slots
        self._ids = self._cells[self.HEADER : self.HEADER + slots]
        self._rows = self._cells[self.HEADER + slots :]

    @property
    def size(self) -> int:
        return int(self._cells[0])

    @contextmanager
    def _locked(self):  # noqa: ANN202
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids`` (int64 array); ``-1`` where an id has no row yet. Lock-free."""
        mask = np.uint64(self.slots - 1)
        with np.errstate(over="ignore"):
            slot = (_mix(ids) & mask).astype(np.int64)
        rows = np.full(ids.shape, -1, dtype=np.int64)
        pending = np.arange(ids.size)
        for _ in range(self.slots):
            if pending.size == 0:
                break
            s = slot[pending]
            used = self._used[s] == 1
            hit = used & (self._ids[s] == ids[pending])
            rows[pending[hit]] = self._rows[s[hit]]
            keep = used & ~hit  # occupied by another id: probe the next slot
            pending = pending[keep]
            slot[pending] = (slot[pending] + 1) % self.slots
        return rows

    def lookup_or_insert(
        self, ids: np.ndarray, init_row: Callable[[int, int], None] | None = None
    ) -> np.ndarray:
        """Rows of ``ids``, giving new ids the next free rows.

        ``init_row(row, id)`` fills a new row before it is published, so no process can read it
        uninitialised.
        """
        rows = self.lookup(ids)
        missing = np.flatnonzero(rows < 0)
        if missing.size:
            with self._locked():
                for i in missing:
                    rows[i], _ = self._insert_locked(int(ids[i]), init_row)
        return rows

    def _insert_locked(
        self, key: int, init_row: Callable[[int, int], None] | None = None
    ) -> tuple[int, bool]:
        with np.errstate(over="ignore"):
            slot = int(_mix(np.array([key], dtype=np.int64))[0] & np.uint64(self.slots - 1))
        while self._used[slot] == 1:
            if self._ids[slot] == key:
                return int(self._rows[slot]), False  # another process inserted it meanwhile
            slot = (slot + 1) % self.slots
        row = int(self._cells[0])
        if row >= self.capacity:
            raise TableFullError(
                f"the HybridEmbedding table is full: all {self.capacity} rows are taken by distinct ids; "
                "raise num_embeddings (rows are never evicted)."
            )
        if init_row is not None:
            init_row(row, key)
        self._ids[slot] = key
        self._rows[slot] = row
        self._cells[0] = row + 1
        self._used[slot] = 1  # published last
        return row, True

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """All ``(ids, rows)`` pairs (for checkpoints)."""
        used = np.flatnonzero(self._used == 1)
        return np.array(self._ids[used]), np.array(self._rows[used])

    def restore(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Rebuild from saved pairs (an empty index; the caller copies the rows' values)."""
        with self._locked():
            self._used[:] = 0
            self._cells[0] = 0
            order = np.argsort(rows)
            for key, row in zip(ids[order], rows[order]):
                assigned, _ = self._insert_locked(int(key))
                if assigned != int(row):
                    raise ValueError("a saved id index must number its rows 0..n-1 without gaps.")

    def close(self) -> None:
        os.close(self._fd)
