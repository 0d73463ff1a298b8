"""How each flat gradient bucket is cut into one slice per device of a node.

Slice ``k`` of every bucket belongs to local index ``k``: that device reduces it, keeps it and
updates the matching parameter slice. Sizes follow per-device weights:

- ``"equal"``: the same share for every device (buckets are padded to a multiple of ``L`` so that
  the fast equal-size collectives apply);
- ``"memory"``: proportional to each device's free memory at setup (``torch.cuda.mem_get_info``
  on GPU; available host memory divided among the host's processes on CPU);
- ``"memory+compute"``: free memory times a short matmul-throughput probe;
- an explicit list of ``L`` positive numbers.

Measured weights are cut in whole quanta of 1/64 of a bucket (:func:`quantise_weights`): equal GPUs
report free memory a few MB apart, and slices cut exactly to that would differ by as little, which
costs the reducer its flat reduce-scatter and all-gather (those need equal slices). Devices whose
weights are within a quantum of each other get equal slices.

Measurements differ per rank and per node, but every node must cut buckets identically (slice
``k`` on node A is all-reduced with slice ``k`` on node B). Rank 0 therefore gathers every rank's
measurement, takes for each local index the smallest value over nodes (the weakest device of that
index bounds what it can hold), and broadcasts the resulting plan.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from time import perf_counter

import torch
import torch.distributed as dist

from lightning_hier.checks import is_real

WEIGHT_MODES = ("equal", "memory", "memory+compute")
SLICE_QUANTA = 64  # measured weights are cut in whole 64ths of a bucket (more where a node has more devices)


@dataclass(frozen=True)
class SlicePlan:
    """Normalised per-local-index weights; ``bounds(n)`` turns them into element ranges."""

    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.weights or any(not 0 < w < math.inf for w in self.weights):
            raise ValueError(f"slice weights must be positive and finite, got {self.weights}.")
        weights = self.weights
        total = sum(weights)
        if not math.isfinite(total):  # weights near the float maximum: scaled by the largest first
            largest = max(weights)
            weights = tuple(w / largest for w in weights)
            total = sum(weights)
        object.__setattr__(self, "weights", tuple(w / total for w in weights))

    @property
    def num_slices(self) -> int:
        return len(self.weights)

    @property
    def is_equal(self) -> bool:
        return max(self.weights) - min(self.weights) < 1e-12

    def padded_numel(self, numel: int) -> int:
        """Bucket length to allocate: equal plans round up to a multiple of the slice count."""
        if self.is_equal:
            return -(-numel // self.num_slices) * self.num_slices
        return numel

    def bounds(self, numel: int) -> tuple[tuple[int, int], ...]:
        """Contiguous ``(start, end)`` element ranges, one per slice, covering ``[0, numel)``.

        Boundaries are rounded cumulative shares, so sizes match the weights to within one element.
        """
        edges = [0]
        cumulative = 0.0
        for weight in self.weights[:-1]:
            cumulative += weight
            edges.append(min(numel, max(edges[-1], round(cumulative * numel))))
        edges.append(numel)
        return tuple((edges[i], edges[i + 1]) for i in range(self.num_slices))


def validate_slice_weights(slice_weights: str | Sequence[float], devices_per_node: int | None = None) -> None:
    """Raise ``ValueError`` naming the setting for an unknown mode or a bad explicit list."""
    if isinstance(slice_weights, str):
        if slice_weights not in WEIGHT_MODES:
            raise ValueError(
                f"slice_weights={slice_weights!r} is not a known mode; use one of {list(WEIGHT_MODES)} "
                "or a list of positive numbers, one per device of a node."
            )
        return
    try:
        items = list(slice_weights)
    except TypeError:
        items = [None]
    if not all(is_real(w) for w in items):  # not "1" or True: a misplaced value, not a weight
        raise ValueError(
            f"slice_weights must be one of {list(WEIGHT_MODES)} or a list of positive numbers, "
            f"got {slice_weights!r}."
        )
    values = [float(w) for w in items]
    if not values or any(not (w > 0) or w == float("inf") for w in values):
        raise ValueError(f"slice_weights entries must be positive and finite, got {items}.")
    if devices_per_node is not None and len(values) != devices_per_node:
        raise ValueError(
            f"slice_weights has {len(values)} entries but a node has devices_per_node={devices_per_node} "
            f"devices; give exactly {devices_per_node} weights."
        )


def measure_free_memory(device: torch.device, processes_per_host: int) -> float:
    """Free bytes this rank may count on: device memory on GPU, a share of host memory on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free)
    available = _available_host_memory()
    return available / max(1, processes_per_host)


def _available_host_memory() -> float:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def measure_matmul_throughput(device: torch.device, size: int = 256, repeats: int = 5) -> float:
    """A short probe: multiply-adds per second of a ``size x size`` matmul on ``device``."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    torch.mm(a, b)  # warm-up
    _synchronize(device)
    start = perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    _synchronize(device)
    elapsed = max(perf_counter() - start, 1e-9)
    return repeats * size**3 / elapsed


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decide_slice_plan(
    slice_weights: str | Sequence[float],
    devices_per_node: int,
    device: torch.device,
    processes_per_host: int,
    node_of_rank: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
) -> SlicePlan:
    """Turn the user's ``slice_weights`` into one plan that every rank agrees on.

    Explicit lists and ``"equal"`` need no communication. Measured modes gather every rank's
    measurement (a collective over ``group``, all ranks, with a CPU backend: the values are host
    objects), combine them on rank 0 and broadcast.
    """
    validate_slice_weights(slice_weights, devices_per_node)
    if not isinstance(slice_weights, str):
        return SlicePlan(tuple(float(w) for w in slice_weights))
    if slice_weights == "equal":
        return SlicePlan((1.0,) * devices_per_node)
    value = measure_free_memory(device, processes_per_host)
    if slice_weights == "memory+compute":
        value *= measure_matmul_throughput(device)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return SlicePlan((1.0,) * devices_per_node)
    gathered: list[float | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value, group=group)
    payload: list[SlicePlan | None] = [None]
    if dist.get_rank() == 0:
        payload[0] = combine_measurements([float(v) for v in gathered], devices_per_node)
    dist.broadcast_object_list(payload, src=0, group=group)
    assert payload[0] is not None
    return payload[0]


def combine_measurements(values: Sequence[float], devices_per_node: int) -> SlicePlan:
    """Per local index, the smallest measurement over nodes (rank ``r`` has index ``r % L``)."""
    per_index = [min(values[i::devices_per_node]) for i in range(devices_per_node)]
    floor = max(per_index) * 1e-3  # never give a device a zero-size share
    return SlicePlan(quantise_weights([max(v, floor) for v in per_index]))


def quantise_weights(weights: Sequence[float]) -> tuple[float, ...]:
    """``weights`` as whole quanta of a bucket (1/64 of it; 1/128 for 65 to 128 devices, and so on).

    Weights all within one quantum of each other come out equal: an equal plan, whose buckets are padded
    so that every slice has the same size. Otherwise every device gets at least one quantum and is within
    one quantum of its share, all the quanta in all, so slice edges fall on whole quanta; devices within a
    quantum of the smallest of their run get the same number of quanta wherever the total allows it.
    """
    count = len(weights)
    quanta = SLICE_QUANTA * -(-count // SLICE_QUANTA)
    total = float(sum(weights))
    shares = [w / total * quanta for w in weights]
    if max(shares) - min(shares) < 1.0:
        return (1.0,) * count
    runs: list[list[int]] = []
    for k in sorted(range(count), key=lambda k: (shares[k], k)):
        if runs and shares[k] - shares[runs[-1][0]] < 1.0:
            runs[-1].append(k)
        else:
            runs.append([k])
    given = _quanta_by_runs(shares, runs, quanta) or _quanta_by_largest_remainder(shares, quanta)
    return tuple(float(q) for q in given)


def _quanta_by_runs(shares: list[float], runs: list[list[int]], quanta: int) -> list[int] | None:
    """One count of quanta per run, within one quantum of every member's share, ``quanta`` in all; ``None``
    where no such choice exists. A run spans less than a quantum, so one or two counts fit all its members
    (``low`` and ``low + 1``); which runs take the higher one is a subset sum, solved for the largest
    remainder given out."""
    low = [max(1, math.floor(max(shares[k] for k in run))) for run in runs]
    high = [math.ceil(min(shares[k] for k in run)) for run in runs]  # the largest count below min + 1
    short = quanta - sum(len(run) * q for run, q in zip(runs, low))
    # best[t]: (remainder given out, the runs raised) for the choices raising exactly t devices
    best: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    for r, run in enumerate(runs):
        if high[r] <= low[r]:
            continue
        gain = sum(shares[k] - low[r] for k in run)
        for t, (value, raised) in sorted(best.items(), reverse=True):
            u = t + len(run)
            if u <= short and (u not in best or value + gain > best[u][0]):
                best[u] = (value + gain, (*raised, r))
    if short < 0 or short not in best:
        return None
    given = [0] * len(shares)
    for r, run in enumerate(runs):
        for k in run:
            given[k] = low[r] + (r in best[short][1])
    return given


def _quanta_by_largest_remainder(shares: list[float], quanta: int) -> list[int]:
    """Each share rounded down (at least one quantum), then one more to the largest remainders until the
    total is ``quanta`` (ties: the lower index); over it (the one-quantum minimum), taken back where a
    device holds most above its share."""
    given = [max(1, math.floor(share)) for share in shares]
    left = quanta - sum(given)
    for k in sorted(range(len(shares)), key=lambda k: (given[k] - shares[k], k))[: max(left, 0)]:
        given[k] += 1
    for _ in range(-left):
        k = max((k for k in range(len(shares)) if given[k] > 1), key=lambda k: (given[k] - shares[k], -k))
        given[k] -= 1
    return given
