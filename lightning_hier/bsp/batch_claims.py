"""Shared batches: every worker takes the epoch's next batch from one counter, so a fast worker takes more.

Data parallel normally gives each rank a fixed ``1/world_size`` of the epoch (``DistributedSampler``);
a worker twice as fast then idles at the epoch's end, and since ``hier_bsp``'s epoch ends for everyone
together, the slowest worker sets the epoch's length. :class:`ClaimingSampler` instead walks one
epoch-wide order (the same permutation ``DistributedSampler`` would shuffle from, before splitting it)
in chunks of one batch. Rank ``r`` starts with chunk ``r`` (so every worker trains on at least one
batch per epoch and the epoch starts without a round trip); after that a worker claims the next chunk
with an atomic add on the job's key-value store (the TCP store every ``torch.distributed`` job
already has; one round trip per batch and no collective, so the training thread never waits for
another worker). Every sample is still seen once per epoch.

In lockstep (``in_turn``) no worker can take more batches than another, so claims in arrival order would
only make which batches a superstep sums depend on timing. There worker ``r``'s ``k``-th batch is chunk
``k x num_replicas + r``, without the store: a superstep of ``n`` micro-steps per worker sums the
epoch's next ``n x num_replicas`` chunks, as ``ddp`` with ``n`` accumulated batches sums them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, Sampler
from torch.utils.data.distributed import DistributedSampler


class ClaimingSampler(Sampler[int]):
    """Yields the sample indices of the batches this worker claims, one batch-sized chunk per claim.

    Used under a ``BatchSampler`` of the same ``batch_size``: each claim yields exactly one batch's
    indices (only the epoch's very last chunk may be shorter, and nothing follows it), so batches never
    straddle two claims. Deliberately unsized: how many batches a worker gets is known only at the end.

    ``key``: a store prefix the same on every rank; each pass over the sampler (one per epoch on every
    rank) counts on its own key. Needs at least ``num_replicas`` batches per epoch. ``in_turn``: the
    workers run in lockstep; chunks go to them in turn instead of by claims (module docstring).
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        drop_last: bool,
        key: str,
        rank: int,
        num_replicas: int,
        shuffle: bool = True,
        seed: int = 0,
        store: Any | None = None,
        in_turn: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.key = key
        self.rank = rank
        self.num_replicas = num_replicas
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.passes = 0
        self._store = store
        self.in_turn = in_turn
        if self.num_chunks < num_replicas:
            raise ValueError(
                f"{self.num_chunks} batches of {batch_size} per epoch cannot be shared by "
                f"{num_replicas} workers."
            )

    @classmethod
    def replacing(
        cls, sampler: DistributedSampler, batch_size: int, drop_last: bool, key: str, in_turn: bool = False
    ) -> ClaimingSampler:
        """The claiming equivalent of the ``DistributedSampler`` Lightning put on a train loader."""
        size = len(sampler.dataset)  # type: ignore[arg-type]
        return cls(
            size,
            batch_size,
            drop_last,
            key,
            sampler.rank,
            sampler.num_replicas,
            sampler.shuffle,
            sampler.seed,
            in_turn=in_turn,
        )

    @property
    def num_chunks(self) -> int:
        """Batches in one epoch over all workers."""
        whole, rest = divmod(self.num_samples, self.batch_size)
        return whole if self.drop_last or rest == 0 else whole + 1

    def set_epoch(self, epoch: int) -> None:
        """Lightning calls this before every epoch (as for ``DistributedSampler``): a new shuffle."""
        self.epoch = epoch

    def order(self) -> list[int]:
        """This epoch's order of all samples, the same on every rank."""
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        counter = f"{self.key}/pass{self.passes}"
        self.passes += 1
        order = self.order()
        if self.in_turn:
            for chunk in range(self.rank, self.num_chunks, self.num_replicas):
                yield from order[chunk * self.batch_size : (chunk + 1) * self.batch_size]
            return
        store = self._store if self._store is not None else dist.distributed_c10d._get_default_store()
        chunk = self.rank
        while chunk < self.num_chunks:
            yield from order[chunk * self.batch_size : (chunk + 1) * self.batch_size]
            chunk = self.num_replicas + store.add(counter, 1) - 1


def why_not_claimed(dataloader: object) -> str | None:
    """Why a :class:`ClaimingSampler` cannot take this train loader over (``None``: it can). It can for
    a plain ``DistributedSampler`` drawn by a plain ``BatchSampler`` with enough batches for every rank."""
    sampler = getattr(dataloader, "sampler", None)
    batch_size = getattr(dataloader, "batch_size", None)
    if type(sampler) is not DistributedSampler:
        return f"its sampler is a {type(sampler).__name__}, not the DistributedSampler Lightning adds"
    if batch_size is None or type(getattr(dataloader, "batch_sampler", None)) is not BatchSampler:
        return "it has its own batch_sampler"
    batches = len(sampler.dataset) // batch_size  # type: ignore[arg-type]
    if batches < sampler.num_replicas:
        return f"{batches} full batches per epoch are fewer than the {sampler.num_replicas} workers"
    return None
