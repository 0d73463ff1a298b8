"""Which gradients travel together: the bucket plan.

A :class:`BucketPlan` is a small frozen object listing, in launch order, the parameter indices of
each bucket. It is the replaceable piece of the sync path: the size-capped plan below groups
parameters in reverse registration order (roughly the order backward produces their gradients,
as DDP assumes); a time-planned variant can produce another plan without touching the rest.

Buckets never mix parameters of different *group keys* (optimizer param group, dtype, device):
every bucket is one flat tensor, and its slices feed one param group of the optimizer.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ParamInfo:
    """What the planner needs to know about one trainable parameter."""

    index: int
    numel: int
    element_size: int
    group_key: Hashable


@dataclass(frozen=True)
class BucketPlan:
    """Parameter indices per bucket, buckets in the order they are reduced."""

    buckets: tuple[tuple[int, ...], ...]
    kind: str = "size"

    def __post_init__(self) -> None:
        seen: set[int] = set()
        for bucket in self.buckets:
            if not bucket:
                raise ValueError("a bucket plan must not contain empty buckets.")
            overlap = seen.intersection(bucket)
            if overlap:
                raise ValueError(f"parameters {sorted(overlap)} appear in more than one bucket.")
            seen.update(bucket)

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def bucket_of(self) -> dict[int, int]:
        """Map parameter index -> bucket index."""
        return {p: b for b, bucket in enumerate(self.buckets) for p in bucket}


def plan_size_buckets(params: Sequence[ParamInfo], cap_bytes: int) -> BucketPlan:
    """Greedy size-capped buckets over ``params`` taken in reverse order.

    A bucket closes when adding the next parameter would pass ``cap_bytes`` or when the group key
    changes; a single parameter larger than the cap gets a bucket of its own.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket_cap_mb must be positive, got a cap of {cap_bytes} bytes.")
    buckets: list[tuple[int, ...]] = []
    current: list[int] = []
    current_bytes = 0
    current_key: Hashable = None
    for info in reversed(params):
        size = info.numel * info.element_size
        if current and (info.group_key != current_key or current_bytes + size > cap_bytes):
            buckets.append(tuple(current))
            current, current_bytes = [], 0
        current.append(info.index)
        current_bytes += size
        current_key = info.group_key
    if current:
        buckets.append(tuple(current))
    return BucketPlan(tuple(buckets), kind="size")
