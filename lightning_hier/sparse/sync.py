"""Frequency-averaged synchronisation of sparse (per-id) gradients.

Every trainer holds its gradient as ``(ids, rows)`` with unique ids. The synchronised gradient of
an id is the sum over the trainers in which it occurred divided by the number of those trainers:
an id seen by one trainer gets that trainer's gradient, an id seen by all gets their mean (which
is what DDP's average gives a dense embedding when every id occurs everywhere).

The exchange is hierarchical, so only one node-level copy of each id's rows crosses the slow link,
and the node's processes can share the merge (the update stays with one process per node, the
seed's single updater):

- by default the node leader (local rank 0) collects the node's rows (point to point: each rank
  puts its packed rows in its shared-memory mailbox, :mod:`.staging`, where they fit, else sends
  them, and goes on; nobody waits for anybody's length) and merges them into
  ``(ids, sum, count)``; the leaders of all nodes all-gather those and finish the average;
- with ``share_merge``, each process sends each process of its node the rows of the ids that
  process owns (``id mod devices_per_node``), through shared-memory mailboxes (:mod:`.staging`)
  where they fit, else by message; the owners merge in parallel; the owners of the same share on
  all nodes all-gather theirs (one ``inter`` group per local index, so the slow link's load is
  split over the node's processes); the leader collects the averaged shares, disjoint by
  construction.

Whatever travels together is packed into one message (:func:`pack_rows`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from lightning_hier.sparse.staging import NodeStaging


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


def _send_parcel(
    packed: torch.Tensor, start: int, end: int, staged: bool, group: dist.ProcessGroup, dst: int
) -> list[dist.Work]:
    """Tell group rank ``dst`` where rows ``start:end`` of ``packed`` are: in this rank's mailbox
    (``staged``), else in the message that follows."""
    header = torch.tensor([start, end, int(staged)], dtype=torch.int64)
    works = [dist.isend(header, group=group, group_dst=dst)]
    if not staged and end > start:
        works.append(dist.isend(packed[start:end].contiguous(), group=group, group_dst=dst))
    return works


def _receive_parcels(
    group: dist.ProcessGroup, sources: list[int], width: int, staging: NodeStaging | None, box: str
) -> dict[int, torch.Tensor]:
    """Every source's packed rows, read from its mailbox or received, in whatever order they come."""
    headers = {q: torch.empty(3, dtype=torch.int64) for q in sources}
    announced = {q: dist.irecv(headers[q], group=group, group_src=q) for q in sources}
    parts, receiving = {}, []
    for q in sources:
        announced[q].wait()
        start, end, staged = headers[q].tolist()
        if staged:
            assert staging is not None, f"rank {q} staged rows, but this rank has no mailboxes"
            parts[q] = staging.rows(box, q, start, end)
        else:
            parts[q] = torch.empty(end - start, width, dtype=torch.uint8)
            if end > start:
                receiving.append(dist.irecv(parts[q], group=group, group_src=q))
    for work in receiving:
        work.wait()
    return parts


def merge_partition(
    ids: torch.Tensor, rows: torch.Tensor, group: dist.ProcessGroup, staging: NodeStaging | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's share of the node's merge: ``(ids, sum, count)`` over the node's ranks of the ids
    this rank owns (``id mod group size == group rank``).

    Each rank puts its rows, sorted by owner, into its inbox (or sends each owner its part) and
    tells every owner where its part is; the owners merge in parallel. Point to point: nobody waits
    for a rank it needs nothing from.
    """
    size, me = dist.get_world_size(group), dist.get_rank(group)
    owner = torch.remainder(ids, size)
    order = torch.argsort(owner, stable=True)
    packed = pack_rows([ids[order], rows[order]])
    bounds = torch.searchsorted(owner[order], torch.arange(size + 1, dtype=owner.dtype)).tolist()
    staged = staging is not None and staging.put("inbox", packed)
    others = [q for q in range(size) if q != me]
    sending = [w for p in others for w in _send_parcel(packed, bounds[p], bounds[p + 1], staged, group, p)]
    parts = _receive_parcels(group, others, packed.shape[1], staging, "inbox")
    parts[me] = packed[bounds[me] : bounds[me + 1]]
    merged_ids, merged_rows = unpack_rows(torch.cat([parts[q] for q in range(size)]), [ids, rows])
    for work in sending:
        work.wait()
    return coalesce(merged_ids, merged_rows)


def collect_at_leader(
    tensors: list[torch.Tensor], group: dist.ProcessGroup, staging: NodeStaging | None = None
) -> list[torch.Tensor] | None:
    """Group rank 0 gets every rank's tensors (equal first dimension per rank) concatenated in rank
    order; the others get ``None``. From the outboxes where they fit, else by message."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    packed = pack_rows(tensors)
    if me != 0:
        staged = staging is not None and staging.put("outbox", packed)
        for work in _send_parcel(packed, 0, packed.shape[0], staged, group, 0):
            work.wait()
        return None
    parts = _receive_parcels(group, list(range(1, size)), packed.shape[1], staging, "outbox")
    parts[0] = packed
    return unpack_rows(torch.cat([parts[q] for q in range(size)]), tensors)


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


def _all_gather_varying(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Every rank gets every rank's tensors (equal first dimension per rank, lengths differ between
    ranks) concatenated in rank order: lengths exchanged once, then one padded message of all
    tensors packed."""
    size = dist.get_world_size(group)
    packed = pack_rows(tensors)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([packed.shape[0]], dtype=torch.int64), group=group)
    counts = [int(n.item()) for n in lengths]
    padded = torch.zeros(max(counts), packed.shape[1], dtype=torch.uint8)
    padded[: packed.shape[0]] = packed
    gathered = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    return unpack_rows(torch.cat([g[:n] for g, n in zip(gathered, counts)]), tensors)


def hierarchical_frequency_average(
    ids: torch.Tensor,
    rows: torch.Tensor,
    intra_group: dist.ProcessGroup | None,
    inter_group: dist.ProcessGroup | None,
    is_node_leader: bool,
    staging: NodeStaging | None = None,
    share_merge: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The synchronised ``(ids, rows)`` (ids sorted), returned on the node leaders (local rank 0),
    else ``None``. Every rank of ``intra_group`` calls it.

    ``share_merge=False``: the leader collects the node's rows, merges them and all-gathers the
    node's ``(ids, sum, count)`` with the other leaders over ``inter_group``. ``True``: every rank
    merges the node's rows of the ids it owns (:func:`merge_partition`), finishes their average with
    the ranks of the same local index on the other nodes over ``inter_group`` (so the slow link's
    load is split over the node's processes), and hands the result to the leader. Both give the same
    bits: each id's rows are summed in rank order, then in node order. ``staging``: the node's
    shared-memory mailboxes, used where rows fit.
    """
    ids = ids.to(torch.int64).cpu()
    rows = rows.float().cpu()
    if intra_group is None or dist.get_world_size(intra_group) == 1:
        return _average_across_nodes(*coalesce(ids, rows), inter_group)
    if not share_merge:
        collected = collect_at_leader([ids, rows], intra_group, staging)
        if collected is None or not is_node_leader:
            return None
        return _average_across_nodes(*coalesce(*collected), inter_group)
    part_ids, part_sum, part_count = merge_partition(ids, rows, intra_group, staging)
    averaged = _average_across_nodes(part_ids, part_sum, part_count, inter_group)
    collected = collect_at_leader(list(averaged), intra_group, staging)
    if collected is None or not is_node_leader:
        return None
    all_ids, all_rows = collected
    order = torch.argsort(all_ids)  # the owners' ids are disjoint
    return all_ids[order], all_rows[order]


def _average_across_nodes(
    ids: torch.Tensor, summed: torch.Tensor, count: torch.Tensor, inter_group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if inter_group is not None and dist.get_world_size(inter_group) > 1:
        all_ids, all_counts, all_sums = _all_gather_varying([ids, count, summed], inter_group)
        ids, summed, count = coalesce(all_ids, all_sums, all_counts)
    return ids, summed / count.unsqueeze(1)
