"""Split a batch into micro-batches along dimension 0."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def batch_size(batch: Any) -> int | None:
    """Length along dimension 0 of the first tensor found in ``batch``."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() > 0 else None
    if isinstance(batch, Mapping):
        items = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        items = list(batch)
    else:
        return None
    for item in items:
        size = batch_size(item)
        if size is not None:
            return size
    return None


def _take(batch: Any, start: int, end: int, size: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:end] if batch.dim() > 0 and batch.shape[0] == size else batch
    if isinstance(batch, Mapping):
        return type(batch)({k: _take(v, start, end, size) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_take(v, start, end, size) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_take(v, start, end, size) for v in batch)
    return batch


def split_batch(batch: Any, num_micro: int) -> tuple[list[tuple[Any, int]], int]:
    """``([(micro_batch, its size), ...], batch size)``: at most ``num_micro`` nearly equal parts.

    Tensors whose first dimension is the batch size are split; everything else is passed to
    every micro-batch unchanged. A batch smaller than ``num_micro`` gives one part per sample. A batch
    without a tensor to split (plain values, the ``dataloader_iter`` a step pulls its batch from) runs as
    one micro-batch of size 1.
    """
    size = batch_size(batch)
    if size is None:
        return [(batch, 1)], 1
    parts = max(1, min(num_micro, size))
    base, extra = divmod(size, parts)  # like torch.tensor_split: the first `extra` parts are longer
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return [(_take(batch, a, b, size), b - a) for a, b in zip(bounds, bounds[1:])], size


def input_signature(batch: Any) -> tuple[Any, ...]:
    """What a micro-batch's activation shapes can depend on, read from the micro-batch itself: every
    tensor's shape and dtype and every plain scalar's value, in order (every stage loads the same batch,
    so every stage computes the same signature without a message)."""
    if isinstance(batch, torch.Tensor):
        return ("t", tuple(batch.shape), str(batch.dtype))
    if isinstance(batch, Mapping):
        return ("m", *((k, input_signature(v)) for k, v in batch.items()))
    if isinstance(batch, (list, tuple)):
        return ("s", *(input_signature(v) for v in batch))
    if batch is None or isinstance(batch, (bool, int, float, str)):
        return ("v", batch)
    return ("o", type(batch).__name__)
