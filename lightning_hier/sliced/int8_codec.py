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

The codec makes few passes over the data: blocks are views of the rows (only a row's last, short block is
its own view, nothing is padded by copy), the divisions, rounding and clamping run in place in one scratch
buffer, the int8 values are written straight into the message, the received parts are dequantised by one
multiplication each and error feedback is computed in place in the residual. On the CPU the scratch buffers
are kept across calls (allocating them anew costs a page fault per 4 KiB); on a GPU the caching allocator
already reuses memory, in stream order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

BLOCK = 2048
"""Elements per quantisation block (one fp32 scale each). Blocks down to 128 narrow the loss gap to full
precision under Adam without keeping it within 1 % (docs/hier_sliced.md measures them), so the default is the
block of fewest bytes."""
LEVELS = 127  # int8 values used: -127..127, symmetric, so -x quantises to -q

_scratch = threading.local()  # the CPU's reused buffers, one set per thread (the reducer's own thread)


@dataclass(frozen=True)
class ValueFormat:
    """How one element of a block travels in its byte.

    ``"int8"``: ``round(x / scale)`` with ``scale = max|x| / 127``, equal steps over the block's range.
    ``"fp8"``: ``x / scale`` as float8 e4m3 with ``scale = max|x| / 448``, 3 mantissa bits at every magnitude
    down to about ``2^-15`` of the block's largest, so small elements travel every step (within 1/16 of
    themselves) rather than waiting in the residual."""

    name: str
    top: float  # what the block's largest magnitude is scaled to

    def encode_into(self, values: torch.Tensor, q: torch.Tensor) -> None:
        """``values`` (float, already divided by the scale; overwritten) into ``q`` (int8, the same shape)."""
        if self.name == "int8":
            values.round_().clamp_(-LEVELS, LEVELS)  # round half to even
            q.copy_(values)
        else:
            values.clamp_(-self.top, self.top)  # a value past e4m3's largest would become NaN
            q.view(torch.float8_e4m3fn).copy_(values)  # rounds to nearest even

    def decode_into(self, q: torch.Tensor, values: torch.Tensor) -> None:
        """``q`` (int8) as floats into ``values`` (the same shape), before the scale is applied."""
        if self.name == "int8" or q.device.type != "cpu":
            # int8: integers below 128, exact in every float dtype; float8 converts on the device
            values.copy_(q if self.name == "int8" else q.view(torch.float8_e4m3fn))
            return
        # the CPU converts float8 element by element, several times slower than a lookup of its 256 values
        index = _buffer("fp8_index", tuple(q.shape), torch.int32, q)
        index.copy_(q.view(torch.uint8))
        looked_up = _buffer("fp8_values", (q.numel(),), values.dtype, values)
        torch.index_select(_fp8_table(values.dtype), 0, index.view(-1), out=looked_up)
        values.copy_(looked_up.view(values.shape))


INT8 = ValueFormat("int8", float(LEVELS))
FP8 = ValueFormat("fp8", float(torch.finfo(torch.float8_e4m3fn).max))
_FP8_TABLES: dict[torch.dtype, torch.Tensor] = {}


def _fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """The 256 values of float8 e4m3 by their bits, in ``dtype`` (its two NaN codes as 0: never sent)."""
    table = _FP8_TABLES.get(dtype)
    if table is None:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
        table = _FP8_TABLES[dtype] = codes.to(dtype).nan_to_num_(nan=0.0)
    return table


def blocks_of(length: int, block: int = BLOCK) -> int:
    """How many blocks (and scales) a row of ``length`` elements has."""
    return -(-length // block)


def _buffer(role: str, shape: tuple[int, ...], dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """A scratch tensor of ``shape`` on ``like``'s device (and of its tensor type), whose contents are used
    only until the caller returns."""
    if like.device.type != "cpu":
        return like.new_empty(shape, dtype=dtype)
    numel = 1
    for dim in shape:
        numel *= dim
    buffers = _scratch.__dict__.setdefault("buffers", {})
    key = (role, dtype)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[key] = torch.empty(numel, dtype=dtype)
    view = buffer[:numel].view(shape)
    return view if type(like) is torch.Tensor else view.as_subclass(type(like))


def _sections(length: int, block: int) -> list[tuple[int, int, int]]:
    """A row of ``length`` as ``(first element, blocks, block width)``: its whole blocks, then its short
    one."""
    whole, tail = divmod(length, block)
    sections = [(0, whole, block)] if whole else []
    if tail:
        sections.append((whole * block, 1, tail))
    return sections


def _quantize_into(
    rows: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int, fmt: ValueFormat = INT8
) -> None:
    """Quantise ``rows`` (2-d float, last dim contiguous) into ``q`` (int8, the same shape, may be a strided
    view) and ``scales`` (fp32, ``[rows, blocks_of(row length)]``)."""
    count, length = rows.shape
    work = _buffer("quantize", (count * length,), rows.dtype, rows)
    for first, blocks, width in _sections(length, block):
        x = rows[:, first : first + blocks * width].view(count, blocks, width)
        b = first // block
        # max |x| as max(max x, -min x): two reads, no |x| written out; abs_ gives a block of -0.0 scale +0.0
        top = torch.maximum(x.amax(dim=2), x.amin(dim=2).neg_()).abs_()
        scale = scales[:, b : b + blocks]
        # the scales as they travel (fp32) are the ones divided by, so that dequantize inverts exactly this
        scale.copy_(top.div_(fmt.top))
        divisor = torch.where(scale > 0, scale, 1.0).to(rows.dtype).unsqueeze(2)
        values = work[: count * blocks * width].view(count, blocks, width)
        torch.div(x, divisor, out=values)
        fmt.encode_into(values, q[:, first : first + blocks * width].view(count, blocks, width))


def _dequantize_into(
    q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int, fmt: ValueFormat = INT8
) -> None:
    """``q * scale`` per block into ``out`` (2-d, the shape of ``q``); ``scales`` in the dtype to compute
    in."""
    count, length = q.shape
    for first, blocks, width in _sections(length, block):
        b = first // block
        span = slice(first, first + blocks * width)
        # the values decoded in place, then one multiplication: a mixed int8 * float product would convert
        # through a temporary, many times slower on the CPU
        values = out[:, span].view(count, blocks, width)
        fmt.decode_into(q[:, span].view(count, blocks, width), values)
        values.mul_(scales[:, b : b + blocks].unsqueeze(2))


def quantize(
    rows: torch.Tensor, block: int = BLOCK, fmt: ValueFormat = INT8
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` (2-d, float) as int8 of the same shape and fp32 scales ``[rows, blocks_of(row length)]``:
    each block of a row is ``round(x / scale)`` with ``scale = max|x| / 127`` (0 for a block of zeros), or
    with ``fmt=FP8`` the bytes of ``x / scale`` in float8 e4m3 with ``scale = max|x| / 448``."""
    count, length = rows.shape
    work = rows.float() if rows.dtype != torch.float64 else rows
    if work.stride(-1) != 1:
        work = work.contiguous()
    q = rows.new_empty((count, length), dtype=torch.int8)
    scales = rows.new_empty((count, blocks_of(length, block)), dtype=torch.float32)
    _quantize_into(work, q, scales, block, fmt)
    return q, scales


def dequantize(
    q: torch.Tensor,
    scales: torch.Tensor,
    block: int = BLOCK,
    dtype: torch.dtype = torch.float32,
    fmt: ValueFormat = INT8,
) -> torch.Tensor:
    """What :func:`quantize` encoded, in ``dtype``: ``q * scale`` per block, the shape of ``q``."""
    out = q.new_empty(q.shape, dtype=dtype)
    _dequantize_into(q if q.stride(-1) == 1 else q.contiguous(), scales.to(dtype), out, block, fmt)
    return out


def pack(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One int8 message per row: the row's values, then its scales' bytes."""
    return torch.cat([q, scales.contiguous().view(torch.int8)], dim=1)


def unpack(message: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack` undone for rows of ``length`` values."""
    return message[:, :length], message[:, length:].contiguous().view(torch.float32)


def _flat_collective(name: str, older_name: str):  # noqa: ANN202
    # looked up at each call, so that the wrappers of CommProfiler and the audit see the call
    return getattr(dist, name, None) or getattr(dist, older_name)


def _row_groups(flat: torch.Tensor, part: int) -> list[tuple[int, torch.Tensor]]:
    """``flat`` (1-d) cut into rows of ``part`` as views: ``(first row, rows)`` for its whole rows, then for
    its short last row; the rows after it (padding) are not in ``flat`` at all."""
    n = flat.numel()
    whole, tail = divmod(n, part)
    groups = [(0, flat[: whole * part].view(whole, part))] if whole else []
    if tail:
        groups.append((whole, flat[whole * part :].view(1, tail)))
    return groups


@torch.no_grad()
def int8_all_reduce(
    out: torch.Tensor,
    residual: torch.Tensor | None,
    group: dist.ProcessGroup,
    block: int = BLOCK,
    fmt: ValueFormat = INT8,
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
    blocks = blocks_of(part, block)
    width = part + 4 * blocks
    compute = torch.float64 if out.dtype == torch.float64 else torch.float32
    if residual is not None:
        out.add_(residual)
    if out.dtype == compute and out.is_contiguous():
        source = out
    else:
        source = _buffer("source", (n,), compute, out)
        source.copy_(out.reshape(-1))
    # the all-to-all is waited for below, so on the CPU its buffers are free again when this call returns
    message = _buffer("message", (size, width), torch.int8, out)
    scales = _buffer("scales", (size, blocks), torch.float32, out)
    if n < size * part:  # the padding: zeros, and scale 0 for blocks of nothing but padding
        full = n // part
        message[full:].zero_()
        scales[full:].zero_()
    sent = None
    if residual is not None:
        sent = residual if residual.dtype == compute and residual.is_contiguous() else None
        if sent is None:
            sent = _buffer("sent", (n,), compute, out)
    for row, rows in _row_groups(source, part):
        count, length = rows.shape
        q = message[row : row + count, :length]
        row_scales = scales[row : row + count]
        _quantize_into(rows, q, row_scales, block, fmt)
        if sent is not None:  # what this rank's parts lose in transit: x - q * scale, in place
            sent_rows = sent[row * part : row * part + count * length].view(count, length)
            _dequantize_into(q, row_scales.to(compute), sent_rows, block, fmt)
            torch.sub(rows, sent_rows, out=sent_rows)
    if residual is not None and sent is not residual:
        residual.copy_(sent.view(residual.shape))
    message[:, part:].copy_(scales.view(torch.int8))
    received = _buffer("received", (size, width), torch.int8, out)
    dist.all_to_all_single(received, message, group=group, async_op=True).wait()
    summands = _buffer("summands", (size, part), compute, out)
    _dequantize_into(received[:, :part], unpack(received, part)[1].to(compute), summands, block, fmt)
    total = _buffer("total", (1, part), compute, out)
    torch.sum(summands, dim=0, keepdim=True, out=total)
    # the all-gather is asynchronous: its buffers are its own, never reused
    outgoing = out.new_empty((1, width), dtype=torch.int8)
    scales_sum = out.new_empty((1, blocks), dtype=torch.float32)
    _quantize_into(total, outgoing[:, :part], scales_sum, block, fmt)
    outgoing[:, part:].copy_(scales_sum.view(torch.int8))
    if residual is not None:
        lo, hi = min(rank * part, n), min((rank + 1) * part, n)
        if hi > lo:  # what quantising the sum dropped from this rank's part: total - q * scale
            dropped = summands[:1, : hi - lo]
            _dequantize_into(outgoing[:, : hi - lo], scales_sum.to(compute), dropped, block, fmt)
            torch.sub(total[:, : hi - lo], dropped, out=dropped)
            residual[lo:hi].add_(dropped[0])
        # a non-finite gradient (an fp16 loss scale that overflowed) is dropped with its step; carried in the
        # residual it would make every later step non-finite too
        residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    gathered = out.new_empty((size, width), dtype=torch.int8)
    all_gather = _flat_collective("all_gather_single", "all_gather_into_tensor")
    work = all_gather(gathered, outgoing, group=group, async_op=True)

    def finish() -> None:
        # may run on another thread than the call: it writes into ``out`` only, no shared scratch buffer
        gathered_scales = unpack(gathered, part)[1].to(compute)
        if out.is_contiguous():
            for row, rows in _row_groups(out, part):
                count, length = rows.shape
                q = gathered[row : row + count, :length]
                _dequantize_into(q, gathered_scales[row : row + count], rows, block, fmt)
        else:
            summed = dequantize(gathered[:, :part], gathered_scales, block, compute, fmt).reshape(-1)[:n]
            out.copy_(summed.view(out.shape))

    return work, finish
