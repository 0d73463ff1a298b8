"""Whether every pipeline stage reads the same batch, checked at the first batch of each epoch.

Stage 0 computes on a batch's inputs and the last stage on its targets, each from its own loader. Where the
loaders disagree the pipeline trains on inputs paired with another sample's targets, and nothing fails: a
loader that shards by rank (``torch.distributed.get_rank()``, webdataset's ``split_by_node``), or a collate
function that draws random masks and their labels from the global random stream (a masked-language-model
collator; the stages consume that stream differently), gives each stage its own batches.

The fingerprint compares what must agree: every tensor's shape, and the values of integer and bool tensors
(labels, token ids, masks). Float tensors are compared by shape only, so random augmentation of the inputs
(each stage draws its own crops; only stage 0's are used) is not reported.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection


def batch_fingerprint(batch: Any) -> torch.Tensor:
    """``[tensors, total elements, shape digest, integer-value digest]`` of ``batch`` (float64, host)."""
    tensors: list[torch.Tensor] = []
    apply_to_collection(batch, torch.Tensor, tensors.append)
    shape_digest = 0.0
    value_digest = 0.0
    numel = 0
    for index, tensor in enumerate(tensors, start=1):
        numel += tensor.numel()
        for axis, size in enumerate(tensor.shape, start=1):
            shape_digest += index * axis * size
        if not (tensor.is_floating_point() or tensor.is_complex()):
            # weighted by position, so that two rows swapped between stages change the digest
            flat = tensor.detach().reshape(-1).to(torch.float64)
            weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
            value_digest += index * float((flat * weights.remainder(97).add(1)).sum())
    return torch.tensor([len(tensors), numel, shape_digest, value_digest], dtype=torch.float64)


def stages_disagree(batch: Any, group: Any) -> bool:
    """Whether any stage's fingerprint of its batch differs from this one's (the same answer on every rank:
    every rank compares all of them)."""
    mine = batch_fingerprint(batch)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return any(not torch.equal(other, gathered[0]) for other in gathered[1:])
