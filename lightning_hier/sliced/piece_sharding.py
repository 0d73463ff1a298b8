"""A sharded optimizer whose state is kept per parameter piece, so an unused parameter is skipped
exactly as ``ddp`` skips it.

:class:`~lightning_hier.sliced.sharded_optim.OptimizerSharding` gives the optimizer one tensor per
bucket slice: fast, but a scalar state such as Adam's step count then advances for every parameter
of the slice whenever any of them has a gradient. ``hier_sliced`` answers that by moving a
parameter that was unused in some steps into a bucket of its own (a rebuild between steps). The
``hier_bsp`` server cannot rebuild between supersteps (its workers keep folding into buckets of the
same layout meanwhile), so it uses this sharding instead: the optimizer steps one *piece* per
parameter and slice (the part of the parameter inside this rank's slice, a view of the slice), and
a piece whose parameter no worker used gets no gradient, so torch's optimizer leaves it, its
moments and its step count alone, as under ``ddp`` with ``find_unused_parameters=True``. A piece that is a
whole parameter (always so with ``devices_per_node=1``, where a rank's slice is the whole bucket) has the
parameter's shape, so an optimizer that reads shapes or whole-tensor norms (Adafactor, LARS-like trust
ratios) steps it as under ``ddp``.

The checkpoint layout is the unsharded optimizer's, as for the bucket sharding: a parameter with no
state (never used) has no entry, as in torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_hier.sliced.reducer import all_gather_slices
from lightning_hier.sliced.sharded_optim import OptimizerSharding, is_elementwise_state


@dataclass
class Piece:
    """The part ``[lo, hi)`` (flat offsets into the parameter) of parameter ``index`` that lies in
    this rank's slice of bucket ``bucket``, as the optimizer's parameter ``param`` (a view)."""

    bucket: int
    index: int
    lo: int
    hi: int
    at: int  # offset into the rank's slice
    param: nn.Parameter


class PieceSharding(OptimizerSharding):
    """:class:`OptimizerSharding` with the optimizer's parameters split at parameter boundaries."""

    @cached_property
    def pieces(self) -> list[Piece]:
        """One piece per parameter and slice: views of this rank's slices, at parameter boundaries."""
        pieces = []
        for b, (bucket, shard) in enumerate(zip(self.buckets, self.shards)):
            start, end = bucket.owned_range
            for slot, lo, hi in bucket.slots_in(start, end):
                at = slot.offset + lo - start
                view = shard.data[at : at + hi - lo]
                if lo == 0 and hi == slot.numel:  # a whole parameter keeps its shape (Adafactor reads it)
                    view = view.view(slot.shape)
                pieces.append(Piece(b, slot.index, lo, hi, at, nn.Parameter(view, requires_grad=False)))
        return pieces

    def _optimizer_params(self, group_index: int) -> list[nn.Parameter]:
        """What the optimizer steps for param group ``group_index``: the pieces of its buckets."""
        return [p.param for p in self.pieces if self.bucket_group[p.bucket] == group_index]

    def give_gradients(self, slice_grads: Sequence[torch.Tensor], unused: Iterable[int] = ()) -> None:
        """Point every piece's ``.grad`` into its bucket's gradient slice; none for ``unused``
        parameters (indices), which the step then skips."""
        skipped = set(unused)
        for piece in self.pieces:
            grad = slice_grads[piece.bucket][piece.at : piece.at + piece.hi - piece.lo]
            piece.param.grad = None if piece.index in skipped else grad.view(piece.param.shape)

    # ------------------------------------------------------------------ checkpoints
    def _gathered_piece_states(self) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, torch.dtype]]]:
        """Every rank's scalar state and elementwise keys per parameter index (host objects)."""
        scalars: dict[int, dict[str, Any]] = {}
        elementwise: dict[int, dict[str, torch.dtype]] = {}
        for piece in self.pieces:
            for key, value in self.optimizer.state.get(piece.param, {}).items():
                if is_elementwise_state(key, value, piece.param.shape):
                    elementwise.setdefault(piece.index, {})[key] = value.dtype
                else:
                    host = value.cpu() if torch.is_tensor(value) else value
                    scalars.setdefault(piece.index, {})[key] = host
        mine = (scalars, elementwise)
        theirs: list[Any] = [mine]
        if dist.get_world_size(self.intra_group) > 1:
            theirs = [None] * dist.get_world_size(self.intra_group)
            dist.all_gather_object(theirs, mine, group=self.intra_group)  # host objects: CPU backend
        merged_scalars: dict[int, dict[str, Any]] = {}
        merged_keys: dict[int, dict[str, torch.dtype]] = {}
        for rank_scalars, rank_keys in theirs:
            for index, values in rank_scalars.items():
                merged_scalars.setdefault(index, {}).update(values)
            for index, keys in rank_keys.items():
                merged_keys.setdefault(index, {}).update(keys)
        return merged_scalars, merged_keys

    def consolidated_state_dict(self) -> dict[str, Any]:
        """The unsharded optimizer's ``state_dict()`` (a collective over the node's ranks)."""
        scalars, keys = self._gathered_piece_states()
        device = self.buckets[0].device if self.buckets else torch.device("cpu")
        state: dict[int, dict[str, Any]] = {}
        for b, bucket in enumerate(self.buckets):
            bucket_keys = {k: d for slot in bucket.slots for k, d in keys.get(slot.index, {}).items()}
            bucket_pieces = [piece for piece in self.pieces if piece.bucket == b]
            for key, dtype in sorted(bucket_keys.items()):  # every rank walks the same keys
                full = torch.zeros(bucket.padded_numel, dtype=dtype, device=device)
                start = bucket.owned_range[0]
                for piece in bucket_pieces:
                    value = self.optimizer.state.get(piece.param, {}).get(key)
                    if value is not None:
                        full[start + piece.at : start + piece.at + value.numel()].copy_(value.reshape(-1))
                for work in all_gather_slices(full, bucket.bounds, self.intra_group):
                    work.wait()
                for slot in bucket.slots:
                    if key in keys.get(slot.index, {}):
                        entry = state.setdefault(self._saved_index(slot.index), {})
                        entry[key] = full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
            for slot in bucket.slots:
                for key, value in scalars.get(slot.index, {}).items():
                    entry = state.setdefault(self._saved_index(slot.index), {})
                    entry[key] = value.clone() if torch.is_tensor(value) else value
        return {"state": state, "param_groups": self.saved_param_groups()}

    def load_consolidated_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take this rank's pieces out of an unsharded ``state_dict`` (no communication)."""
        self._check_and_load_groups(state_dict)
        saved_state = {int(k): v for k, v in state_dict["state"].items()}
        self.optimizer.state.clear()
        for piece in self.pieces:
            saved = saved_state.get(self._saved_index(piece.index), {})
            shape = self._param_of_index[piece.index].shape
            new_state: dict[str, Any] = {}
            for key, value in saved.items():
                if is_elementwise_state(key, value, shape):
                    device = piece.param.device
                    part = value.reshape(-1)[piece.lo : piece.hi].reshape(piece.param.shape)
                    new_state[key] = part.to(device).clone()
                else:
                    new_state[key] = value.clone() if torch.is_tensor(value) else value
            if new_state:
                self.optimizer.state[piece.param] = new_state

    def local_state_numel(self) -> int:
        """Elements of per-element optimizer state held by this rank (for memory checks)."""
        total = 0
        for piece in self.pieces:
            for key, value in self.optimizer.state.get(piece.param, {}).items():
                if is_elementwise_state(key, value, piece.param.shape):
                    total += value.numel()
        return total
