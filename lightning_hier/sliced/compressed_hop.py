"""The inter-node all-reduce in fewer bytes than the gradients (``inter_node_dtype``), with error feedback.

``hier_sliced``'s reducer and ``hier_bsp``'s parameter server send the slow hop through
:func:`start_compressed_all_reduce`: ``"bf16"`` / ``"fp16"`` cast the slice and all-reduce it in the narrow
dtype (half the bytes of fp32); ``"int8"`` sends blocks of int8 with one fp32 scale each
(:mod:`lightning_hier.sliced.int8_codec`, about a quarter), and ``"fp8"`` the same blocks with each value as
float8 e4m3 (the same bytes; small elements keep 3 mantissa bits instead of rounding to 0). Either way what
rounding dropped from a slice is kept in its ``residual`` and added to the next call's input, so summed over
steps nothing is lost but what is still owed.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_hier.sliced.int8_codec import BLOCK, FP8, INT8, int8_all_reduce

INTER_NODE_DTYPES: dict[str | None, torch.dtype | None] = {
    None: None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "int8": torch.int8,  # blocks of int8 with an fp32 scale each (int8_codec.py)
    "fp8": torch.float8_e4m3fn,  # the same blocks, each value as float8 e4m3
}
BLOCKED = {torch.int8: INT8, torch.float8_e4m3fn: FP8}  # the dtypes sent as scaled blocks, and how


def inter_node_dtype_of(name: object) -> torch.dtype | None:
    """The torch dtype of an ``inter_node_dtype`` setting; anything but ``None``, ``"bf16"``, ``"fp16"``,
    ``"int8"`` and ``"fp8"`` raises ``ValueError`` naming the value."""
    if not isinstance(name, (str, type(None))) or name not in INTER_NODE_DTYPES:
        raise ValueError(
            f"inter_node_dtype={name!r} is not one of {list(INTER_NODE_DTYPES)} (None: full precision)."
        )
    return INTER_NODE_DTYPES[name]


def compresses(dtype: torch.dtype | None, gradients: torch.dtype) -> bool:
    """Whether a hop in ``dtype`` sends ``gradients`` in fewer bytes (a bf16 model's bf16 hop does not)."""
    return dtype is not None and dtype != gradients


def hop_bytes(numel: int, element_size: int, dtype: torch.dtype | None, group_size: int) -> int:
    """Bytes one rank puts on the link for an all-reduce of ``numel`` elements over ``group_size`` ranks,
    counted as a ring's ``(n - 1) / n`` of the payload: the payload is ``numel`` elements of
    ``element_size`` bytes, or of ``dtype``'s size, or for int8 and fp8 each part's values and block
    scales."""
    if group_size <= 1:
        return 0
    if dtype in BLOCKED:
        part = -(-numel // group_size)
        payload = group_size * (part + 4 * (-(-part // BLOCK)))
    else:
        size = element_size if dtype is None else dtype.itemsize
        payload = numel * size
    return math.ceil(payload * (group_size - 1) / group_size)


@torch.no_grad()
def start_compressed_all_reduce(
    out: torch.Tensor, residual: torch.Tensor | None, dtype: torch.dtype, group: dist.ProcessGroup
) -> tuple[dist.Work, Callable[[], None]]:
    """Start the sum of ``out`` (1-d) over ``group`` in ``dtype``; returns the last collective's work and what
    writes the sum into ``out`` once that work is done (on a GPU: on a stream ordered after it).

    ``residual`` (the shape of ``out``, or ``None`` for no error feedback) is added to ``out`` first and left
    holding what this call's rounding dropped. A non-finite input (an fp16 loss scale that overflowed) is
    dropped from the residual with its step: carried on, it would make every later step non-finite too.
    """
    if dtype in BLOCKED:
        # all-to-all, sum, all-gather; on gloo this waits for the all-to-all
        return int8_all_reduce(out, residual, group, BLOCK, BLOCKED[dtype])
    if residual is not None:
        out.add_(residual)
    narrow = out.to(dtype)
    if residual is not None:
        torch.sub(out, narrow, out=residual)
        residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # inf - inf
    work = dist.all_reduce(narrow, group=group, async_op=True)

    def finish() -> None:
        out.copy_(narrow)

    return work, finish
