"""The inter-node hop in blocks of int8 with one fp32 scale per block (``inter_node_dtype="int8"``).

Each block of :data:`BLOCK` elements travels as ``round(x / scale)`` in int8 with ``scale = max|x| / 127``
(a block of zeros has scale 0), so an element comes back within ``scale / 2`` of what was sent. The
all-reduce of one slice piece across nodes is the two steps of DeepSpeed ZeRO++'s quantised gradients (qgZ):

1. a reduce-scatter by all-to-all: the piece is cut into one part per node, each part quantised and sent to
   the node that owns it; the owner dequantises what every node sent it and sums in fp32 (int8 itself never
   adds up, so nothing overflows);
2. an all-gather of the owners' sums, quantised again, which every node dequantises into the piece.

Both steps carry one message each: the int8 values and the scales' bytes packed side by side (one
collective rather than two, so the slow link's latency is paid once per step). On a ring the link then
carries about ``(1 + 4 / BLOCK) / 4`` of a full-precision all-reduce's bytes.

Error feedback (``residual``): what quantising the parts this rank sent left out, and on the owner what
quantising the sum left out of its part, are added to the next step's input; summed over steps, what
arrives is what was given less what is still owed (the current residuals of all nodes).

Every tensor here is on the gradients' device and every size is a host integer, so the hop reads nothing
back from the device; its two collectives are issued on the inter-node group in the same order on every
rank. gloo runs ``all_to_all_single`` and the flat all-gather on int8 CPU tensors (torch 2.13), so the same
calls serve gloo and NCCL.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

BLOCK = 2048
"""Elements per quantisation block (one fp32 scale each)."""
LEVELS = 127  # int8 values used: -127..127, symmetric, so -x quantises to -q


def blocks_of(length: int, block: int = BLOCK) -> int:
    """How many blocks (and scales) a row of ``length`` elements has."""
    return -(-length // block)


def quantize(rows: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` (2-d, float) as int8 of the same shape and fp32 scales ``[rows, blocks_of(row length)]``:
    each block of a row is ``round(x / scale)`` with ``scale = max|x| / 127`` (0 for a block of zeros)."""
    count, length = rows.shape
    nb = blocks_of(length, block)
    work = rows.float() if rows.dtype != torch.float64 else rows
    padded = F.pad(work, (0, nb * block - length)).view(count, nb, block)
    # the scales as they travel (fp32) are the ones divided by, so that dequantize inverts exactly this
    scales = (padded.abs().amax(dim=2) / LEVELS).float()
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).to(work.dtype)
    values = torch.round(padded / divisor.unsqueeze(2)).clamp_(-LEVELS, LEVELS)
    q = values.view(count, nb * block)[:, :length].to(torch.int8)
    return q, scales


def dequantize(
    q: torch.Tensor, scales: torch.Tensor, block: int = BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """What :func:`quantize` encoded, in ``dtype``: ``q * scale`` per block, the shape of ``q``."""
    count, length = q.shape
    nb = scales.shape[1]
    padded = F.pad(q.to(dtype), (0, nb * block - length)).view(count, nb, block)
    return (padded * scales.to(dtype).unsqueeze(2)).view(count, nb * block)[:, :length]


def pack(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One int8 message per row: the row's values, then its scales' bytes."""
    return torch.cat([q, scales.contiguous().view(torch.int8)], dim=1)


def unpack(message: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack` undone for rows of ``length`` values."""
    return message[:, :length], message[:, length:].contiguous().view(torch.float32)


def _flat_collective(name: str, older_name: str):  # noqa: ANN202
    # looked up at each call, so that the wrappers of CommProfiler and the audit see the call
    return getattr(dist, name, None) or getattr(dist, older_name)


@torch.no_grad()
def int8_all_reduce(
    out: torch.Tensor,
    residual: torch.Tensor | None,
    group: dist.ProcessGroup,
    block: int = BLOCK,
) -> tuple[dist.Work, Callable[[], None]]:
    """Start the sum of ``out`` (1-d) over ``group`` in int8 blocks; returns the all-gather's work and
    what writes the sum into ``out`` once that work is done.

    Issues the all-to-all and waits for it (on a GPU the current stream waits, not the host; on gloo the
    calling thread blocks), sums, then issues the all-gather asynchronously. ``residual`` (the shape of
    ``out``): error feedback, added to ``out`` first and left holding what this step's quantisation
    dropped.
    """
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    n = out.numel()
    part = -(-n // size)
    compute = torch.float64 if out.dtype == torch.float64 else torch.float32
    if residual is not None:
        out.add_(residual)
    rows = F.pad(out.to(compute), (0, size * part - n)).view(size, part)
    q, scales = quantize(rows, block)
    if residual is not None:
        sent = dequantize(q, scales, block, compute).reshape(-1)[:n]
        torch.sub(out, sent, out=residual)
    message = pack(q, scales)
    received = torch.empty_like(message)
    dist.all_to_all_single(received, message, group=group, async_op=True).wait()
    total = dequantize(*unpack(received, part), block, compute).sum(dim=0, keepdim=True)
    q_sum, scales_sum = quantize(total, block)
    if residual is not None:
        lo, hi = min(rank * part, n), min((rank + 1) * part, n)
        dropped = total - dequantize(q_sum, scales_sum, block, compute)
        residual[lo:hi].add_(dropped[0, : hi - lo])
        # a non-finite gradient (an fp16 loss scale that overflowed) is dropped with its step; carried in the
        # residual it would make every later step non-finite too
        residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    gathered = torch.empty((size, message.shape[1]), dtype=torch.int8, device=out.device)
    all_gather = _flat_collective("all_gather_single", "all_gather_into_tensor")
    work = all_gather(gathered, pack(q_sum, scales_sum), group=group, async_op=True)

    def finish() -> None:
        summed = dequantize(*unpack(gathered, part), block, compute).reshape(-1)[:n]
        out.copy_(summed)

    return work, finish
