"""Gradient-ready timeline -> clustered time points -> a time-planned :class:`BucketPlan`.

Backward produces gradients in bursts: a layer's weight and bias arrive together, then comes
the compute of the next layer down. Profiling records, for every parameter, when its gradient
became ready (seconds after backward started), averaged over steps and ranks. Clustering that
1-D timeline gives time points ``t_1 < ... < t_n``; bucket ``i`` holds the gradients produced in
``(t_{i-1}, t_i]`` and is sent as soon as backward passes ``t_i`` with all of them ready.

Clustering is gap-based: sort the ready times and cut wherever the gap to the next gradient is
larger than ``gap_fraction`` of the whole backward duration. Gaps are exactly where a bucket can
go out without waiting for anything, and one threshold relative to the backward time needs no
number of clusters chosen in advance (unlike k-means) and is deterministic. Two bounds then
shape the clusters: a cluster smaller than ``min_bucket_bytes`` is merged into the next one (a
collective's latency would dominate it), and a cluster larger than ``cap_bytes`` is split by size
(a huge bucket would delay the start of communication).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from lightning_hier.bucketing.size_plan import BucketPlan, ParamInfo


@dataclass(frozen=True)
class TimePlan:
    """Time points (seconds after backward start) and the bucket plan they induce."""

    time_points: tuple[float, ...]
    plan: BucketPlan
    bucket_bytes: tuple[int, ...]
    backward_seconds: float

    def describe(self) -> str:
        points = ", ".join(f"{t * 1e3:.2f}" for t in self.time_points)
        sizes = ", ".join(f"{b / 2**20:.2f}" for b in self.bucket_bytes)
        return f"{len(self.time_points)} time point(s) [ms]: {points}; bucket sizes [MB]: {sizes}"

    def to_dict(self) -> dict:
        return {
            "time_points": list(self.time_points),
            "buckets": [list(b) for b in self.plan.buckets],
            "bucket_bytes": list(self.bucket_bytes),
            "backward_seconds": self.backward_seconds,
        }

    @classmethod
    def from_dict(cls, data: dict) -> TimePlan:
        return cls(
            tuple(float(t) for t in data["time_points"]),
            BucketPlan(tuple(tuple(int(i) for i in b) for b in data["buckets"]), kind="time"),
            tuple(int(b) for b in data["bucket_bytes"]),
            float(data["backward_seconds"]),
        )


def plan_misfit(plan: TimePlan, params: Sequence[ParamInfo]) -> str | None:
    """Why ``plan`` (e.g. from a checkpoint) cannot drive these parameters, or ``None`` if it can.

    Every parameter in exactly one bucket, each bucket's bytes equal to its parameters' bytes now,
    and no bucket mixing group keys (param group, dtype, device): a plan for another model, or for
    the same model with other shapes, dtypes or param groups, does not fit.
    """
    indices = sorted(i for bucket in plan.plan.buckets for i in bucket)
    if indices != list(range(len(params))):
        return f"it covers parameters {indices[:8]}... but the model has {len(params)}"
    if len(plan.bucket_bytes) != plan.plan.num_buckets:
        return "its bucket sizes do not match its buckets"
    for b, (bucket, saved) in enumerate(zip(plan.plan.buckets, plan.bucket_bytes)):
        now = sum(params[i].numel * params[i].element_size for i in bucket)
        if now != saved:
            return f"bucket {b} held {saved} bytes, its parameters now take {now}"
        keys = {params[i].group_key for i in bucket}
        if len(keys) > 1:
            mixed = sorted(map(str, keys))
            return f"bucket {b} would mix parameters of different groups, dtypes or devices: {mixed}"
    return None


def cluster_ready_times(
    times: Sequence[float], sizes: Sequence[int], gap_threshold: float, min_bytes: int, cap_bytes: int
) -> list[list[int]]:
    """Cluster indices of ``times`` (ascending time) by gaps, then apply the size bounds."""
    order = sorted(range(len(times)), key=lambda i: (times[i], -i))
    clusters: list[list[int]] = []
    for position, index in enumerate(order):
        if position == 0 or times[index] - times[order[position - 1]] > gap_threshold:
            clusters.append([])
        clusters[-1].append(index)
    bounded: list[list[int]] = []
    for cluster in clusters:
        current: list[int] = []
        current_bytes = 0
        for index in cluster:
            if current and current_bytes + sizes[index] > cap_bytes:
                bounded.append(current)
                current, current_bytes = [], 0
            current.append(index)
            current_bytes += sizes[index]
        if current:
            bounded.append(current)
    merged: list[list[int]] = []
    carry: list[int] = []
    for cluster in bounded:
        carry = carry + cluster
        if sum(sizes[i] for i in carry) >= min_bytes:
            merged.append(carry)
            carry = []
    if carry:
        if merged and sum(sizes[i] for i in merged[-1]) + sum(sizes[i] for i in carry) <= cap_bytes:
            merged[-1].extend(carry)
        else:
            merged.append(carry)
    return merged


def plan_time_buckets(
    params: Sequence[ParamInfo],
    ready_times: Sequence[float | None],
    backward_seconds: float,
    cap_bytes: int,
    min_bytes: int,
    gap_fraction: float = 0.02,
) -> TimePlan:
    """Build the time plan; parameters that never produced a gradient go into the last bucket.

    Buckets never mix group keys (param group, dtype, device): a cluster spanning several keys
    is split into one bucket per key, in order of first appearance.
    """
    if len(params) != len(ready_times):
        raise ValueError(f"{len(params)} parameters but {len(ready_times)} ready times.")
    seen = [i for i, t in enumerate(ready_times) if t is not None]
    unseen = [i for i, t in enumerate(ready_times) if t is None]
    times = [float(ready_times[i]) for i in seen]  # type: ignore[arg-type]
    sizes = [params[i].numel * params[i].element_size for i in seen]
    gap = max(gap_fraction * backward_seconds, 1e-7)
    clusters = [[seen[j] for j in c] for c in cluster_ready_times(times, sizes, gap, min_bytes, cap_bytes)]
    if unseen:
        clusters.append(unseen)
    buckets: list[tuple[int, ...]] = []
    points: list[float] = []
    for cluster in clusters:
        for key_members in _split_by_key(cluster, [params[i].group_key for i in range(len(params))]):
            buckets.append(tuple(params[i].index for i in key_members))
            cluster_times = [ready_times[i] for i in key_members if ready_times[i] is not None]
            points.append(max(cluster_times) if cluster_times else backward_seconds)
    plan = BucketPlan(tuple(buckets), kind="time")
    by_index = {p.index: p for p in params}
    bucket_bytes = tuple(sum(by_index[i].numel * by_index[i].element_size for i in b) for b in buckets)
    return TimePlan(tuple(points), plan, bucket_bytes, backward_seconds)


def _split_by_key(members: Sequence[int], keys: Sequence[Hashable]) -> list[list[int]]:
    groups: dict[Hashable, list[int]] = {}
    for index in members:
        groups.setdefault(keys[index], []).append(index)
    return list(groups.values())
