"""Frequency-averaged synchronisation of sparse (per-id) gradients.

Every trainer holds its gradient as ``(ids, rows)`` with unique ids. The synchronised gradient of
an id is the sum over the trainers in which it occurred divided by the number of those trainers:
an id seen by one trainer gets that trainer's gradient, an id seen by all gets their mean (which
is what DDP's average gives a dense embedding when every id occurs everywhere).

The exchange is hierarchical, so only one node-level copy crosses the slow link: trainers of a
node gather at local rank 0 (``dist.gather``: the others receive nothing), which merges them into
``(ids, sum, count)``; the local ranks 0 of all nodes all-gather those and finish the average.
Tensors of different lengths travel padded to the longest, with their lengths exchanged once.
"""

from __future__ import annotations

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


def _exchange_padded(
    tensors: list[torch.Tensor], group: dist.ProcessGroup, to_leader_only: bool = False
) -> list[list[torch.Tensor]]:
    """Gather tensors whose first dimension differs between ranks (all share that length per rank).

    Lengths are exchanged once; every tensor travels padded to the longest. With
    ``to_leader_only`` only group rank 0 receives (``dist.gather``): the other ranks of a node
    need nobody's gradients, so they should not receive them. Returns, per tensor, the list of
    every rank's tensor (on receivers; empty lists elsewhere).
    """
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    length = torch.tensor([tensors[0].shape[0]], dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(lengths, length, group=group)
    counts = [int(n.item()) for n in lengths]
    longest = max(counts)
    receiving = not to_leader_only or rank == 0
    result: list[list[torch.Tensor]] = []
    for tensor in tensors:
        padded = torch.zeros((longest, *tensor.shape[1:]), dtype=tensor.dtype)
        padded[: tensor.shape[0]] = tensor
        gathered = [torch.empty_like(padded) for _ in range(size)] if receiving else None
        if to_leader_only:
            dist.gather(padded, gathered, group=group, group_dst=0)
        else:
            dist.all_gather(gathered, padded, group=group)
        result.append([g[:n] for g, n in zip(gathered, counts)] if receiving else [])
    return result


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
        gathered_ids, gathered_rows = _exchange_padded([ids, rows], intra_group, to_leader_only=True)
        if not is_node_leader:
            return None
        node_ids, node_sum, node_count = coalesce(torch.cat(gathered_ids), torch.cat(gathered_rows))
    else:
        node_ids, node_sum, node_count = coalesce(ids, rows)
    if inter_group is not None and dist.get_world_size(inter_group) > 1:
        all_ids, all_counts, all_sums = _exchange_padded([node_ids, node_count, node_sum], inter_group)
        node_ids, node_sum, node_count = coalesce(
            torch.cat(all_ids), torch.cat(all_sums), torch.cat(all_counts)
        )
    return node_ids, node_sum / node_count.unsqueeze(1)
