"""The binary parameter-file format of embedding tables, and memory-mapping it.

Layout (little endian)::

    offset  size  field
    0       8     magic  b"LHEMBTBL"
    8       4     version (uint32, currently 1)
    12      4     dtype code (uint32: 0 float32, 1 float16, 2 bfloat16, 3 float64)
    16      8     rows (uint64)
    24      8     dim (uint64)
    32      32    reserved (zeros)
    64      ...   rows x dim elements, row-major

Opening maps the rows with ``numpy.memmap`` (``bfloat16`` via its int16 bit pattern), so a table
larger than RAM is served through the page cache. Bad files raise :class:`TableFileError`
naming the file and what does not match.
"""

from __future__ import annotations

import contextlib
import os
import struct
import warnings
from pathlib import Path
from typing import Literal

import numpy as np
import torch

MAGIC = b"LHEMBTBL"
VERSION = 1
HEADER_BYTES = 64
_ROWS_PER_WRITE = 1 << 16
_HEADER = struct.Struct("<8sIIQQ")
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float64: 3,
}
_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
_NUMPY_STORAGE = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.bfloat16: np.int16,
    torch.float64: np.float64,
}


class TableFileError(ValueError):
    """A parameter file that is not a valid embedding table."""


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def write_header(handle, rows: int, dim: int, dtype: torch.dtype) -> None:  # noqa: ANN001
    if dtype not in DTYPE_CODES:
        raise TableFileError(f"dtype {dtype} cannot be stored; use one of {list(DTYPE_CODES)}.")
    header = _HEADER.pack(MAGIC, VERSION, DTYPE_CODES[dtype], rows, dim)
    handle.write(header + b"\0" * (HEADER_BYTES - len(header)))


def create_table_file(
    path: str | os.PathLike, rows: int, dim: int, dtype: torch.dtype = torch.float32
) -> None:
    """Create a zero-filled table file of the right size (sparse on disk until written)."""
    with open(path, "wb") as handle:
        write_header(handle, rows, dim, dtype)
        handle.truncate(HEADER_BYTES + rows * dim * element_size(dtype))


def save_table(path: str | os.PathLike, table: torch.Tensor) -> None:
    """Write a 2-D tensor as a table file (atomically: a temporary file is renamed at the end)."""
    if table.dim() != 2:
        raise TableFileError(f"a table is 2-D (rows x dim), got shape {tuple(table.shape)} for {path}.")
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        write_header(handle, table.shape[0], table.shape[1], table.dtype)
        for start in range(0, table.shape[0], _ROWS_PER_WRITE):  # chunks: no second copy of a huge table
            data = table[start : start + _ROWS_PER_WRITE].detach().contiguous().cpu()
            if data.dtype == torch.bfloat16:
                data = data.view(torch.int16)
            handle.write(data.numpy().data)  # the rows themselves: a bytes copy is a chunk malloc may keep
    os.replace(tmp, path)


def read_header(path: str | os.PathLike) -> tuple[int, int, torch.dtype]:
    """``(rows, dim, dtype)`` of a table file, after checking magic, version, dtype and size."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            raw = handle.read(HEADER_BYTES)
    except OSError as err:
        raise TableFileError(f"cannot read embedding table file {path}: {err}") from err
    if len(raw) < HEADER_BYTES:
        raise TableFileError(
            f"{path} is truncated: {len(raw)} bytes, shorter than the {HEADER_BYTES}-byte header."
        )
    magic, version, code, rows, dim = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise TableFileError(f"{path} is not an embedding table file: magic {magic!r}, expected {MAGIC!r}.")
    if version != VERSION:
        raise TableFileError(
            f"{path} has format version {version}; this lightning_hier reads version {VERSION}."
        )
    if code not in _CODE_DTYPES:
        raise TableFileError(f"{path} has unknown dtype code {code}; known codes are {sorted(_CODE_DTYPES)}.")
    dtype = _CODE_DTYPES[code]
    expected = HEADER_BYTES + rows * dim * element_size(dtype)
    if size != expected:
        raise TableFileError(
            f"{path}: header says {rows} rows x {dim} dim of {dtype} = {expected} bytes with the header, "
            f"but the file has {size} bytes."
        )
    return rows, dim, dtype


# Linux >= 5.14: fill the mapping's page tables now (madvise(2)); Python 3.11's mmap module does not name them
_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23


def map_table(
    path: str | os.PathLike, writable: bool = True, populate: Literal["read", "write"] | None = None
) -> torch.Tensor:
    """Memory-map a table file as a ``rows x dim`` tensor sharing the file's pages.

    ``populate``: map every page into this process now, so that touching a row never takes a page fault
    later: ``"read"`` for a process that only reads rows, ``"write"`` for the one that updates them (on a
    disk file it marks every page dirty, so only for a file that is written anyway). A process that maps
    a table takes a minor fault at the first touch of each page (4 processes reading a benchmark step's
    rows of a 1 GB ``/dev/shm`` table: about 200 faults and +0.7 ms per step each, 8-10 ms in the first
    steps); populating costs 0.1-0.5 s per GB once, and 2 MB of page tables per GB per process, which
    touching every row would cost anyway. Kernels without ``MADV_POPULATE_*`` (before 5.14) map pages on
    first touch, as without it.
    """
    if populate not in (None, "read", "write") or (populate == "write" and not writable):
        raise ValueError(f"populate={populate!r} must be None, 'read' or (for a writable map) 'write'.")
    rows, dim, dtype = read_header(path)
    if rows * dim == 0:
        return torch.empty(rows, dim, dtype=dtype)
    array = np.memmap(path, dtype=_NUMPY_STORAGE[dtype], mode="r+" if writable else "r", offset=HEADER_BYTES,
                      shape=(rows, dim))  # fmt: skip
    if populate is not None:
        _populate(array, populate == "write")
    with warnings.catch_warnings():  # a read-only map is only ever read from
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor


def _populate(array: np.memmap, for_writes: bool) -> None:
    mapping = getattr(array, "_mmap", None)  # numpy's mmap.mmap behind the array
    if mapping is None or not hasattr(mapping, "madvise"):
        return
    with contextlib.suppress(OSError):  # an older kernel (EINVAL): pages are mapped at first touch instead
        mapping.madvise(_MADV_POPULATE_WRITE if for_writes else _MADV_POPULATE_READ)
