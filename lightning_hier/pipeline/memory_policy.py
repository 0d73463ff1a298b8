"""Per-layer activation memory policy of one pipeline stage: keep, swap or recompute.

After every repartition a stage knows, per layer, how many bytes the layer stashes for backward
(``saved_bytes``), how many bytes its inputs take (``input_bytes``, what a non-reentrant checkpoint
keeps when the layer is recomputed) and how long its forward and backward take. From those,
:func:`decide_memory_plan` picks one policy per layer:

* ``keep``: the stash stays on the device (fastest, most memory);
* ``swap``: the stash goes to host memory during forward and comes back for backward (costs
  host-link time, which overlaps with compute as long as the stage's total swap time stays under
  its forward+backward time);
* ``recompute``: only the layer's inputs are kept and its forward is re-run in backward (costs the
  layer's forward time again).

The decision follows a greedy rule: layers are ranked by ``swap cost / recompute cost``
(``saved_bytes / swap_bandwidth`` over ``forward_seconds``), highest first; they are swapped in
that order while the summed swap time is below the stage's forward+backward time (the layer
that crosses it is still swapped); if the estimated peak still exceeds ``memory_limit`` the next
layers in the same order are recomputed one by one until it fits; everything else is kept. The
optimisation only runs when the plan in force does not fit, or fits while layers recompute, and then
starts from scratch, so a stage with enough memory keeps everything. :func:`estimate_peak_bytes` says
what the estimate counts and what it leaves out.

This module is pure Python (no torch); :mod:`lightning_hier.pipeline.activation_store` applies a
plan at run time and measures the inputs of the decision.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

KEEP, SWAP, RECOMPUTE = "keep", "swap", "recompute"
POLICIES = (KEEP, SWAP, RECOMPUTE)

__all__ = [
    "KEEP",
    "POLICIES",
    "RECOMPUTE",
    "SWAP",
    "LayerMemoryStats",
    "MemoryLimitError",
    "MemoryPlan",
    "decide_memory_plan",
    "estimate_host_bytes",
    "estimate_peak_bytes",
    "estimate_resident_bytes",
    "format_bytes",
    "minimum_peak_bytes",
    "needs_new_plan",
]


class MemoryLimitError(ValueError):
    """``memory_limit`` cannot be met by any keep/swap/recompute plan the policy may choose.

    ``memory_limit`` and ``required_bytes`` (the smallest limit that would work) are attributes,
    so callers can report or retry with a larger limit.
    """

    def __init__(self, message: str, *, memory_limit: int, required_bytes: int) -> None:
        super().__init__(message)
        self.memory_limit = memory_limit
        self.required_bytes = required_bytes


@dataclass(frozen=True)
class LayerMemoryStats:
    """What the policy needs to know about one layer, per micro-batch.

    ``saved_bytes``: bytes the layer stashes for backward when kept (its activations).
    ``input_bytes``: bytes of the layer's tensor inputs, what a non-reentrant checkpoint keeps on
    the device when the layer is recomputed.
    ``forward_seconds`` / ``backward_seconds``: the layer's forward and backward time.
    """

    name: str
    saved_bytes: int
    input_bytes: int
    forward_seconds: float
    backward_seconds: float

    def __post_init__(self) -> None:
        if self.saved_bytes < 0 or self.input_bytes < 0:
            raise ValueError(
                f"layer {self.name!r}: saved_bytes and input_bytes must be >= 0, "
                f"got {self.saved_bytes} and {self.input_bytes}."
            )
        for field in ("forward_seconds", "backward_seconds"):
            value = getattr(self, field)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"layer {self.name!r}: {field} must be finite and >= 0, got {value}.")

    def swap_seconds(self, swap_bandwidth: float) -> float:
        """Host-link time to swap this layer's stash, ``saved_bytes / swap_bandwidth``."""
        return self.saved_bytes / swap_bandwidth

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "saved_bytes": self.saved_bytes,
            "input_bytes": self.input_bytes,
            "forward_seconds": self.forward_seconds,
            "backward_seconds": self.backward_seconds,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LayerMemoryStats:
        return cls(
            name=str(data["name"]),
            saved_bytes=int(data["saved_bytes"]),
            input_bytes=int(data["input_bytes"]),
            forward_seconds=float(data["forward_seconds"]),
            backward_seconds=float(data["backward_seconds"]),
        )


def format_bytes(num: float) -> str:
    """``1536 -> '1.5 KiB'``: human-readable bytes for messages and plan summaries."""
    value = float(num)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class MemoryPlan:
    """One stage's per-layer activation policy, with the numbers it was decided from.

    ``policies``: ``(layer name, policy)`` pairs in the order of the stats given to
    :func:`decide_memory_plan`. ``estimated_peak_bytes``: the peak estimated for this plan.
    ``swap_seconds``: summed host-link time of the swapped layers per micro-batch.
    ``budget_seconds``: the stage's forward+backward time per micro-batch, the threshold swapping
    stops at. ``estimated_host_bytes``: host memory the swapped activations take.
    ``str(plan)`` gives a one-line summary for logs.
    """

    policies: tuple[tuple[str, str], ...]
    estimated_peak_bytes: int
    swap_seconds: float
    budget_seconds: float
    estimated_host_bytes: int = 0

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for name, policy in self.policies:
            if policy not in POLICIES:
                raise ValueError(f"layer {name!r}: unknown policy {policy!r}, expected one of {POLICIES}.")
            if name in seen:
                raise ValueError(f"layer {name!r} appears twice in the plan.")
            seen.add(name)

    def policy(self, name: str) -> str:
        """The policy of layer ``name``; ``KEEP`` for layers the plan does not know."""
        for layer, policy in self.policies:
            if layer == name:
                return policy
        return KEEP

    def as_mapping(self) -> dict[str, str]:
        """``{layer name: policy}``, e.g. for a stage's ``policies`` attribute."""
        return dict(self.policies)

    def count(self, policy: str) -> int:
        """How many layers have ``policy``."""
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}, expected one of {POLICIES}.")
        return sum(1 for _, p in self.policies if p == policy)

    def names(self, policy: str) -> list[str]:
        """Names of the layers with ``policy``, in plan order."""
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}, expected one of {POLICIES}.")
        return [name for name, p in self.policies if p == policy]

    def to_dict(self) -> dict[str, Any]:
        """JSON-compatible form; :meth:`from_dict` reverses it."""
        return {
            "policies": [[name, policy] for name, policy in self.policies],
            "estimated_peak_bytes": self.estimated_peak_bytes,
            "swap_seconds": self.swap_seconds,
            "budget_seconds": self.budget_seconds,
            "estimated_host_bytes": self.estimated_host_bytes,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemoryPlan:
        return cls(
            policies=tuple((str(name), str(policy)) for name, policy in data["policies"]),
            estimated_peak_bytes=int(data["estimated_peak_bytes"]),
            swap_seconds=float(data["swap_seconds"]),
            budget_seconds=float(data["budget_seconds"]),
            estimated_host_bytes=int(data.get("estimated_host_bytes", 0)),
        )

    def __str__(self) -> str:
        return (
            f"keep {self.count(KEEP)}, swap {self.count(SWAP)} "
            f"({self.swap_seconds:.3f} s of {self.budget_seconds:.3f} s), "
            f"recompute {self.count(RECOMPUTE)}, peak {format_bytes(self.estimated_peak_bytes)}"
            + (
                f" (+{format_bytes(self.estimated_host_bytes)} on the host)"
                if self.estimated_host_bytes
                else ""
            )
        )


def _check_policy(name: str, policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"layer {name!r}: unknown policy {policy!r}, expected one of {POLICIES}.")
    return policy


def _device_stash(layer: LayerMemoryStats, policy: str) -> int:
    if policy == KEEP:
        return layer.saved_bytes
    if policy == SWAP:
        return 0
    return layer.input_bytes


def _backward_peak(stats: Sequence[LayerMemoryStats], policies: Mapping[str, str], held_bytes: int) -> int:
    """Most bytes one micro-batch has on the device at once while its backward runs.

    Backward walks the layers in reverse, freeing each layer's stash after its backward, so at
    layer ``i`` what is alive is the held bytes, the stash of the layers before ``i`` and what
    layer ``i`` brings back: a kept layer its ``saved_bytes``; a recomputed one its inputs and its
    re-materialised ``saved_bytes``; a swapped one its ``saved_bytes`` and, as the runner
    prefetches, the previous swapped layer's (the previous one that swapped anything), which then
    stays until its own backward while the layers in between run beside it.
    """
    policy = [_check_policy(layer.name, policies.get(layer.name, KEEP)) for layer in stats]
    stash = [_device_stash(layer, p) for layer, p in zip(stats, policy)]
    previous_swapped: list[int | None] = []
    last: int | None = None
    for i, layer in enumerate(stats):
        previous_swapped.append(last)
        if policy[i] == SWAP and layer.saved_bytes > 0:
            last = i
    before = held_bytes + sum(stash)  # alive when backward starts
    peak = before
    prefetched = 0  # a swapped layer already brought back, waiting for its backward
    for i in reversed(range(len(stats))):
        before -= stash[i]  # now: held bytes + the stash of layers 0 .. i-1
        layer = stats[i]
        if policy[i] == SWAP and layer.saved_bytes > 0:
            earlier = previous_swapped[i]
            prefetched = stats[earlier].saved_bytes if earlier is not None else 0
            current = layer.saved_bytes + prefetched
        elif policy[i] == RECOMPUTE:
            current = stash[i] + layer.saved_bytes + prefetched
        else:
            current = stash[i] + prefetched
        peak = max(peak, before + current)
    return peak


def estimate_peak_bytes(
    stats: Sequence[LayerMemoryStats],
    policies: Mapping[str, str],
    in_flight: int,
    base_bytes: int = 0,
    held_bytes: int = 0,
) -> int:
    """Estimated peak device bytes of the stage's activations under ``policies``.

    ``base_bytes + (in_flight - 1) * resident + backward peak``. ``resident`` is what one
    micro-batch keeps on the device between its forward and its backward: ``held_bytes`` (what the
    schedule holds whatever the policy: the input received from the previous stage and the output
    sent on) plus each layer's stash (a kept layer its ``saved_bytes``, a swapped one nothing, a
    recomputed one its ``input_bytes``). The backward peak is the most one micro-batch has at once
    during its backward (see :func:`_backward_peak`: recomputed layers re-materialise, swapped
    layers come back with the previous swapped layer prefetched). Layers missing from ``policies``
    count as kept. Not included, and the margin to expect against an allocator's peak: the
    gradients flowing through backward (about two activations of the widest layer), parameter
    gradient temporaries (one layer's parameters) and one-time library workspaces (on CUDA, cuBLASLt
    takes 1 MiB for the autograd thread's first matrix product, which a recomputed layer's forward
    in backward can be: measured on an H200).
    """
    if in_flight < 1:
        raise ValueError(f"in_flight must be >= 1, got {in_flight}.")
    if held_bytes < 0:
        raise ValueError(f"held_bytes must be >= 0, got {held_bytes}.")
    resident = held_bytes
    for layer in stats:
        resident += _device_stash(layer, _check_policy(layer.name, policies.get(layer.name, KEEP)))
    return base_bytes + (in_flight - 1) * resident + _backward_peak(stats, policies, held_bytes)


def estimate_resident_bytes(
    stats: Sequence[LayerMemoryStats], policies: Mapping[str, str], in_flight: int, held_bytes: int = 0
) -> int:
    """Device bytes the activations take when every micro-batch in flight has run its forward."""
    stash = sum(
        _device_stash(layer, _check_policy(layer.name, policies.get(layer.name, KEEP))) for layer in stats
    )
    return in_flight * (held_bytes + stash)


def estimate_host_bytes(
    stats: Sequence[LayerMemoryStats], policies: Mapping[str, str], in_flight: int
) -> int:
    """Host bytes the swapped layers take: their ``saved_bytes`` per micro-batch in flight."""
    swapped = sum(layer.saved_bytes for layer in stats if policies.get(layer.name, KEEP) == SWAP)
    return in_flight * swapped


def minimum_peak_bytes(
    stats: Sequence[LayerMemoryStats], in_flight: int, base_bytes: int = 0, held_bytes: int = 0
) -> int:
    """A floor under every plan's peak: held bytes per micro-batch plus the largest layer's stash.

    Whatever its policy, the layer that stashes the most is on the device once (kept, brought back
    or recomputed). Below this no ``memory_limit`` can be met; :func:`decide_memory_plan` raises
    :class:`MemoryLimitError` naming it.
    """
    if in_flight < 1:
        raise ValueError(f"in_flight must be >= 1, got {in_flight}.")
    transient = max((layer.saved_bytes for layer in stats), default=0)
    return base_bytes + in_flight * held_bytes + transient


def _swap_order(stats: Sequence[LayerMemoryStats], swap_bandwidth: float) -> list[int]:
    """Layer indices by ``swap time / forward time``, highest first (zero forward time first)."""

    def ratio(i: int) -> float:
        layer = stats[i]
        if layer.forward_seconds == 0:
            return math.inf
        return layer.swap_seconds(swap_bandwidth) / layer.forward_seconds

    return sorted(range(len(stats)), key=lambda i: -ratio(i))  # stable: ties keep stats order


def decide_memory_plan(
    stats: Sequence[LayerMemoryStats],
    *,
    in_flight: int,
    memory_limit: int | None,
    swap_bandwidth: float,
    base_bytes: int = 0,
    held_bytes: int = 0,
    previous: MemoryPlan | None = None,
) -> MemoryPlan:
    """Choose keep / swap / recompute per layer so the stage's activations fit ``memory_limit``.

    ``stats``: the stage's layers, per micro-batch. ``in_flight``: micro-batches whose activations
    are alive at once (e.g. the number of warm-up forwards of a 1F1B schedule). ``memory_limit``:
    device bytes the stage may use for activations (``None``: unlimited). ``swap_bandwidth``:
    host-link bytes per second. ``base_bytes``: device bytes already in use that count against the
    limit. ``held_bytes``: bytes per micro-batch the schedule holds whatever the policy (received
    input, output sent on; see :func:`estimate_peak_bytes`). ``previous``: the plan in force
    (layers it does not name, e.g. just migrated in, count as kept). Storage is optimised when the
    stage's memory under the plan in force does not fit the limit, or fits but some layer recomputes
    (memory may have freed up, so recomputation may no longer be needed); optimising runs the greedy
    swap-then-recompute rule of the module docstring from scratch. Otherwise the plan in force is kept as
    it is (with no plan yet: keep everything).

    Raises :class:`MemoryLimitError` (a ``ValueError``) when ``memory_limit`` is below
    :func:`minimum_peak_bytes`, or when the greedy rule ends with every layer swapped or recomputed
    and still above the limit (the message names the limit that would work).
    """
    if in_flight < 1:
        raise ValueError(f"in_flight must be >= 1, got {in_flight}.")
    if not swap_bandwidth > 0 or math.isinf(swap_bandwidth):
        raise ValueError(
            f"swap_bandwidth must be a positive number of bytes per second, got {swap_bandwidth}."
        )
    if memory_limit is not None and memory_limit <= 0:
        raise ValueError(f"memory_limit must be None or > 0 bytes, got {memory_limit}.")
    if base_bytes < 0:
        raise ValueError(f"base_bytes must be >= 0, got {base_bytes}.")
    if previous is not None and not isinstance(previous, MemoryPlan):
        raise TypeError(f"previous must be a MemoryPlan or None, got {type(previous).__name__}.")
    names = [layer.name for layer in stats]
    if len(set(names)) != len(names):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"layer names must be unique, repeated: {duplicates}.")

    if memory_limit is not None:
        minimum = minimum_peak_bytes(stats, in_flight, base_bytes, held_bytes)
        if memory_limit < minimum:
            raise MemoryLimitError(
                f"memory_limit={memory_limit} bytes is below the {minimum} bytes this stage needs even "
                f"with every layer swapped or recomputed; raise memory_limit to at least {minimum}",
                memory_limit=memory_limit,
                required_bytes=minimum,
            )

    budget = sum(layer.forward_seconds + layer.backward_seconds for layer in stats)
    policies = {name: KEEP for name in names}

    def peak() -> int:
        return estimate_peak_bytes(stats, policies, in_flight, base_bytes, held_bytes)

    def plan(swap_seconds: float) -> MemoryPlan:
        return MemoryPlan(
            policies=tuple((name, policies[name]) for name in names),
            estimated_peak_bytes=peak(),
            estimated_host_bytes=estimate_host_bytes(stats, policies, in_flight),
            swap_seconds=swap_seconds,
            budget_seconds=budget,
        )

    if memory_limit is None:
        return plan(0.0)
    # Storage optimisation only when the plan in force does not fit or recomputes; otherwise it stays.
    in_force = dict(previous.policies) if previous is not None else {}
    policies.update({name: in_force[name] for name in names if name in in_force})
    fits = peak() <= memory_limit
    if fits and RECOMPUTE not in policies.values():
        kept_swaps = sum(
            layer.swap_seconds(swap_bandwidth) for layer in stats if policies[layer.name] == SWAP
        )
        return plan(kept_swaps)
    policies = {name: KEEP for name in names}  # optimising starts from scratch: every layer kept

    order = _swap_order(stats, swap_bandwidth)
    swap_seconds = 0.0
    position = 0
    while position < len(order):
        layer = stats[order[position]]
        policies[layer.name] = SWAP
        swap_seconds += layer.swap_seconds(swap_bandwidth)
        position += 1
        if swap_seconds >= budget:
            break

    while position < len(order) and peak() > memory_limit:
        policies[stats[order[position]].name] = RECOMPUTE
        position += 1

    result = plan(swap_seconds)
    if result.estimated_peak_bytes > memory_limit:
        raise MemoryLimitError(
            f"memory_limit={memory_limit} bytes cannot be met: with {result.count(SWAP)} layers swapped "
            f"({swap_seconds:.6f} s of host-link time against the {budget:.6f} s forward+backward budget) "
            f"and the other {result.count(RECOMPUTE)} recomputed the estimate is "
            f"{result.estimated_peak_bytes} bytes; raise memory_limit to at least "
            f"{result.estimated_peak_bytes}, or raise swap_bandwidth so that more layers can be swapped",
            memory_limit=memory_limit,
            required_bytes=result.estimated_peak_bytes,
        )
    return result


def needs_new_plan(
    plan: MemoryPlan | None,
    current_peak: int,
    memory_limit: int | None,
    *,
    free_fraction: float = 0.1,
) -> bool:
    """Whether the stage should call :func:`decide_memory_plan` again.

    True when there is no plan yet; when ``memory_limit`` is set and ``current_peak`` (the measured
    or estimated peak under ``plan``) exceeds it; or when ``plan`` recomputes layers and memory has
    freed up: no limit any more, or ``current_peak`` at least ``free_fraction`` of the limit below
    it (so a peak hovering just under the limit does not flip the plan back and forth).
    """
    if not 0 <= free_fraction < 1:
        raise ValueError(f"free_fraction must be in [0, 1), got {free_fraction}.")
    if plan is None:
        return True
    if memory_limit is not None and current_peak > memory_limit:
        return True
    if plan.count(RECOMPUTE) == 0:
        return False
    return memory_limit is None or current_peak <= (1.0 - free_fraction) * memory_limit
