"""Tensors inside Python objects sent through ``torch.distributed``'s object collectives.

``gather_object`` pickles what it sends, and a pickled tensor goes through ``torch.save`` (its
storage's ``__reduce__``). Lightning's checkpoint tests count ``torch.save`` calls to prove that
only rank 0 writes a checkpoint, so the consolidation gather of a non-zero stage must not call it.
Each tensor travels instead as its dtype, shape and raw bytes and is rebuilt on arrival.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class WireTensor:
    """A host tensor as plain bytes (pickles without ``torch.save``)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, tensor: torch.Tensor) -> WireTensor:
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        return cls(tensor.dtype, tuple(tensor.shape), flat.view(torch.uint8).numpy().tobytes())

    def tensor(self) -> torch.Tensor:
        if not self.data:
            return torch.empty(self.shape, dtype=self.dtype)
        raw = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
        return raw.view(self.dtype).reshape(self.shape)


def to_wire(obj: Any) -> Any:
    """``obj`` with every tensor in its dicts, lists and tuples replaced by a :class:`WireTensor`."""
    if isinstance(obj, torch.Tensor):
        return WireTensor.of(obj)
    if isinstance(obj, dict):
        return {key: to_wire(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_wire(value) for value in obj)
    return obj


def from_wire(obj: Any) -> Any:
    """The inverse of :func:`to_wire` (tensors come back on the host)."""
    if isinstance(obj, WireTensor):
        return obj.tensor()
    if isinstance(obj, dict):
        return {key: from_wire(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_wire(value) for value in obj)
    return obj
