"""Leave parameters that no rank used untouched by a step over flat slices.

DDP (``find_unused_parameters=True``) leaves such a parameter's ``.grad`` as ``None`` and torch's
optimizers skip it: no weight decay, no momentum, no state change. A flat slice cannot skip part of
itself, so the elements of unused parameters inside a rank's owned slice (and of their elementwise
optimizer state) are copied before the step and put back after it. A state tensor the step created
for the first time is zeroed there, as fresh as DDP's would be. What cannot be put back is a slice's
scalar step count (Adam's bias correction): it advances for the whole slice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from lightning_hier.sliced.flat_buckets import FlatBucket, ParamSlot
from lightning_hier.sliced.sharded_optim import is_elementwise_state


@dataclass
class UnusedSnapshot:
    """Saved elements per (bucket, range within its owned slice): ``__param__`` and state tensors."""

    entries: list[tuple[int, int, int, dict[str, torch.Tensor]]] = field(default_factory=list)

    @torch.no_grad()
    def restore(self, shards: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        """Put the saved elements back into the stepped shards and their optimizer state."""
        for b, lo, hi, saved in self.entries:
            shard = shards[b]
            shard.data[lo:hi].copy_(saved["__param__"])
            for key, value in optimizer.state.get(shard, {}).items():
                if key in saved:
                    value[lo:hi].copy_(saved[key])
                elif is_elementwise_state(key, value, shard.shape):
                    value[lo:hi].zero_()
        self.entries = []


@torch.no_grad()
def snapshot_unused(
    unused: Iterable[int],
    where: Mapping[int, tuple[int, ParamSlot]],
    buckets: Sequence[FlatBucket],
    shards: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
) -> UnusedSnapshot:
    """Copy the owned elements of the parameters ``unused`` (indices; ``where[i]`` = its bucket and slot)
    and of their elementwise optimizer state, before a step."""
    snapshot = UnusedSnapshot()
    for index in unused:
        bucket_index, slot = where[index]
        start, end = buckets[bucket_index].owned_range
        lo, hi = max(start, slot.offset) - start, min(end, slot.offset + slot.numel) - start
        if lo >= hi:
            continue
        shard = shards[bucket_index]
        saved = {"__param__": shard.detach()[lo:hi].clone()}
        for key, value in optimizer.state.get(shard, {}).items():
            if is_elementwise_state(key, value, shard.shape):
                saved[key] = value[lo:hi].clone()
        snapshot.entries.append((bucket_index, lo, hi, saved))
    return snapshot
