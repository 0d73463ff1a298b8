"""Frequency-averaged synchronisation of sparse (per-id) gradients.

Every trainer holds its gradient as ``(ids, rows)`` with unique ids. The synchronised gradient of
an id is the sum over the trainers in which it occurred divided by the number of those trainers:
an id seen by one trainer gets that trainer's gradient, an id seen by all gets their mean (which
is what DDP's average gives a dense embedding when every id occurs everywhere).

The exchange is hierarchical, so only one node-level copy crosses the slow link: trainers of a
node send theirs to local rank 0 (point to point: the others receive nothing, and nobody waits for
anybody's length), which merges them into ``(ids, sum, count)``; the local ranks 0 of all nodes
all-gather those (padded to the longest, lengths exchanged once) and finish the average. Whatever
travels together is packed into one message (:func:`pack_rows`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def coalesce(ids: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor | None = None):  # noqa: ANN201
    """Sum rows (and counts) of equal ids; returns ``(unique ids, summed rows, summed counts)``."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    summed = torch.zeros(unique.numel(), rows.shape[1], dtype=rows.dtype, device=rows.device)
    summed.index_add_(0, inverse, rows)
    if counts is None:
        counts = torch.ones(ids.numel(), dtype=torch.float32, device=rows.device)
    total = torch.zeros(unique.numel(), dtype=counts.dtype, device=counts.device)
    total.index_add_(0, inverse, counts)
    return unique, summed, total


def frequency_average(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference rule on one process: ``parts`` is one ``(unique ids, rows)`` per trainer."""
    ids = torch.cat([p[0] for p in parts])
    rows = torch.cat([p[1] for p in parts])
    unique, summed, counts = coalesce(ids, rows)
    return unique, summed / counts.unsqueeze(1)


def pack_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors (equal first dimension, any dtypes) side by side as the bytes of one ``uint8`` matrix,
    so that one message carries ids, counts and rows together."""
    as_bytes = [t.reshape(t.shape[0], _row_numel(t)).contiguous().view(torch.uint8) for t in tensors]
    return torch.cat(as_bytes, dim=1)


def unpack_rows(packed: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Undo :func:`pack_rows`: tensors with ``like``'s dtypes and trailing shapes, ``packed``'s length."""
    out, start = [], 0
    for tensor in like:
        width = _row_numel(tensor) * tensor.element_size()
        chunk = torch.empty(packed.shape[0], width, dtype=torch.uint8)  # strides a view can reinterpret
        chunk.copy_(packed[:, start : start + width])
        chunk = chunk.view(tensor.dtype)
        out.append(chunk.reshape(packed.shape[0], *tensor.shape[1:]))
        start += width
    return out


def _row_numel(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape[1:])


def gather_to_leader(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> list[list[torch.Tensor]]:
    """Group rank 0 receives every rank's tensors (equal first dimension per rank, any length).

    Point to point, not a collective: each rank sends its length, then its tensors packed into one
    message, and goes on; the leader takes them in whatever order they come. A padded ``gather``
    would need every rank's length first (an all-gather that waits for the slowest rank) and send
    padding. Returns, on the leader, per tensor the list of every rank's (its own first); elsewhere
    empty lists.
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    packed = pack_rows(tensors)
    if rank != 0:
        dist.send(torch.tensor([packed.shape[0]], dtype=torch.int64), group=group, group_dst=0)
        if packed.shape[0]:
            dist.send(packed, group=group, group_dst=0)
        return [[] for _ in tensors]
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    announced = [dist.irecv(lengths[peer], group=group, group_src=peer) for peer in range(1, size)]
    parts, receiving = [packed], []
    for peer, work in zip(range(1, size), announced):
        work.wait()
        part = torch.empty(int(lengths[peer]), packed.shape[1], dtype=torch.uint8)
        parts.append(part)
        if part.shape[0]:
            receiving.append(dist.irecv(part, group=group, group_src=peer))
    for work in receiving:
        work.wait()
    unpacked = [unpack_rows(part, tensors) for part in parts]
    return [[ranks_tensors[i] for ranks_tensors in unpacked] for i in range(len(tensors))]


def release_from_leader(group: dist.ProcessGroup | None) -> None:
    """Every rank of ``group`` returns once group rank 0 has called this too (after its update).

    The same guarantee as a barrier for what follows (nobody reads a row before the leader wrote
    it), but each rank waits for one message from the leader instead of for every other rank."""
    if group is None or dist.get_world_size(group) == 1:
        return
    token = torch.zeros(1, dtype=torch.uint8)
    if dist.get_rank(group) != 0:
        dist.recv(token, group=group, group_src=0)
        return
    works = [dist.isend(token, group=group, group_dst=peer) for peer in range(1, dist.get_world_size(group))]
    for work in works:
        work.wait()


def _all_gather_varying(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> list[list[torch.Tensor]]:
    """Every rank receives every rank's tensors (equal first dimension per rank, lengths differ
    between ranks): lengths exchanged once, then one padded message of all tensors packed."""
    size = dist.get_world_size(group)
    packed = pack_rows(tensors)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([packed.shape[0]], dtype=torch.int64), group=group)
    counts = [int(n.item()) for n in lengths]
    padded = torch.zeros(max(counts), packed.shape[1], dtype=torch.uint8)
    padded[: packed.shape[0]] = packed
    gathered = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    unpacked = [unpack_rows(g[:n], tensors) for g, n in zip(gathered, counts)]
    return [[ranks_tensors[i] for ranks_tensors in unpacked] for i in range(len(tensors))]


def hierarchical_frequency_average(
    ids: torch.Tensor,
    rows: torch.Tensor,
    intra_group: dist.ProcessGroup | None,
    inter_group: dist.ProcessGroup | None,
    is_node_leader: bool,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The synchronised ``(ids, rows)``, returned on the node leaders (local rank 0), else ``None``.

    A collective: every rank of ``intra_group`` calls it, then the leaders over ``inter_group``.
    """
    ids = ids.to(torch.int64).cpu()
    rows = rows.float().cpu()
    if intra_group is not None and dist.get_world_size(intra_group) > 1:
        # int64 ids travel as int64 (64-bit hashes); only the node leader receives
        gathered_ids, gathered_rows = gather_to_leader([ids, rows], intra_group)
        if not is_node_leader:
            return None
        node_ids, node_sum, node_count = coalesce(torch.cat(gathered_ids), torch.cat(gathered_rows))
    else:
        node_ids, node_sum, node_count = coalesce(ids, rows)
    if inter_group is not None and dist.get_world_size(inter_group) > 1:
        all_ids, all_counts, all_sums = _all_gather_varying([node_ids, node_count, node_sum], inter_group)
        node_ids, node_sum, node_count = coalesce(
            torch.cat(all_ids), torch.cat(all_sums), torch.cat(all_counts)
        )
    return node_ids, node_sum / node_count.unsqueeze(1)
