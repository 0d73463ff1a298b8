"""Flat storage behind the model's parameters and gradients.

Each bucket of the plan owns one flat parameter tensor and one flat gradient tensor. Every model
parameter becomes a view into its bucket (``param.data``) and its ``.grad`` a view into the
bucket's gradient tensor, so autograd accumulates straight into the buffer that is sent, the
optimizer's slice update writes straight into the model, and the all-gather refills the model in
place: no copies between "model" and "communication" layouts.

The parameter objects keep their identity, so the LightningModule, hooks and the user's
references to them stay valid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lightning_hier.bucketing.size_plan import BucketPlan
from lightning_hier.sliced.slicing import SlicePlan


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside its bucket."""

    index: int
    offset: int
    numel: int
    shape: torch.Size


class FlatBucket:
    """One bucket: flat parameters and gradients, its slots and its slice bounds."""

    def __init__(
        self,
        index: int,
        params: Sequence[tuple[int, nn.Parameter]],
        slice_plan: SlicePlan,
        owned_slice: int,
    ) -> None:
        first = params[0][1]
        self.index = index
        self.dtype = first.dtype
        self.device = first.device
        slots, offset = [], 0
        for param_index, param in params:
            slots.append(ParamSlot(param_index, offset, param.numel(), param.shape))
            offset += param.numel()
        self.slots: tuple[ParamSlot, ...] = tuple(slots)
        self.numel = offset
        self.padded_numel = slice_plan.padded_numel(offset)
        self.bounds = slice_plan.bounds(self.padded_numel)
        self.owned_slice = owned_slice
        self.params = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        self.grads = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        # each parameter's .grad view, made once: it stays the parameter's .grad (adopt_gradient then
        # finds it in place), and the hooks read it every backward
        self._grad_views = {
            slot.index: self.grads[slot.offset : slot.offset + slot.numel].view(slot.shape)
            for slot in self.slots
        }
        with torch.no_grad():
            for (_, param), slot in zip(params, self.slots):
                self.params[slot.offset : slot.offset + slot.numel].copy_(param.detach().reshape(-1))
                param.data = self.param_view(slot)
                param.grad = self.grad_view(slot)

    def param_view(self, slot: ParamSlot) -> torch.Tensor:
        return self.params[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def grad_view(self, slot: ParamSlot) -> torch.Tensor:
        return self._grad_views[slot.index]

    @property
    def owned_range(self) -> tuple[int, int]:
        return self.bounds[self.owned_slice]

    def owned_params(self) -> torch.Tensor:
        """View of this rank's parameter slice (updating it updates the model)."""
        start, end = self.owned_range
        return self.params[start:end]

    def slots_in(self, start: int, end: int) -> list[tuple[ParamSlot, int, int]]:
        """Slots overlapping ``[start, end)`` with the overlap as offsets into the slot."""
        overlaps = []
        for slot in self.slots:
            lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
            if lo < hi:
                overlaps.append((slot, lo - slot.offset, hi - slot.offset))
        return overlaps


def build_flat_buckets(
    params: Sequence[nn.Parameter], plan: BucketPlan, slice_plan: SlicePlan, owned_slice: int
) -> list[FlatBucket]:
    """Move ``params`` into flat buckets following ``plan`` (values are preserved)."""
    return [
        FlatBucket(b, [(i, params[i]) for i in bucket], slice_plan, owned_slice)
        for b, bucket in enumerate(plan.buckets)
    ]


def slot_locations(buckets: Sequence[FlatBucket]) -> dict[int, tuple[int, ParamSlot]]:
    """Per parameter index: the index of its bucket and its slot there."""
    return {slot.index: (bucket.index, slot) for bucket in buckets for slot in bucket.slots}


@torch.no_grad()
def adopt_gradient(param: torch.Tensor, view: torch.Tensor, accumulate: bool = False) -> None:
    """Make ``view`` (the parameter's slot in a flat gradient bucket) its ``.grad`` again, taking in a
    gradient autograd put elsewhere: after a ``zero_grad(set_to_none=True)``, or a sparse one (from an
    ``Embedding(sparse=True)`` whose ``.grad`` was unset), which the dense bucket holds densified, the
    same values. ``accumulate``: add it to what the view holds instead of replacing that."""
    grad = param.grad
    if grad is view:  # the common case, once per parameter per backward
        return
    if grad is not None and (grad.is_sparse or grad.data_ptr() != view.data_ptr()):
        dense = grad.to_dense() if grad.is_sparse else grad
        if accumulate:
            view.add_(dense)
        else:
            view.copy_(dense)
    param.grad = view
