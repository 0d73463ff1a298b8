"""A communication cost model: what each technique moves and how long it takes, before a job runs.

The alpha-beta model: a message of ``n`` bytes over a link costs ``alpha + n / beta``. A ring
all-reduce of ``S`` bytes over ``p`` endpoints takes ``2 (p - 1)`` steps and each endpoint sends
``2 (p - 1) / p * S`` bytes; a reduce-scatter or an all-gather is half of that. A node's inter-node
link (its NIC) carries the traffic of all its devices that talk across nodes. See docs/cost_model.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_hier.checks import check_integer, check_megabytes, is_real

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1}
INT8_BLOCK = 2048  # elements per fp32 scale of the int8 hop (lightning_hier.sliced.int8_codec.BLOCK)
# per element on the inter-node hop; fp8 travels in int8's blocks
HOP_BYTES = {"bfloat16": 2.0, "int8": 1.0 + 4.0 / INT8_BLOCK, "fp8": 1.0 + 4.0 / INT8_BLOCK}


@dataclass(frozen=True)
class Cluster:
    """``nodes x devices_per_node`` devices; bandwidths in bytes/s, latency in seconds."""

    nodes: int
    devices_per_node: int
    intra_bandwidth: float  # per device, inside a node (NVLink, PCIe, loopback)
    inter_bandwidth: float  # per node: the node's link to the others
    latency: float = 5e-6  # alpha of one message step (both links)

    def __post_init__(self) -> None:
        for name in ("nodes", "devices_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        for name in ("intra_bandwidth", "inter_bandwidth"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of bytes per second, got {value!r}.")
        if not (isinstance(self.latency, (int, float)) and math.isfinite(self.latency) and self.latency >= 0):
            raise ValueError(f"latency must be >= 0 seconds, got {self.latency!r}.")

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node


@dataclass(frozen=True)
class Estimate:
    """Predicted communication of one training step (or one superstep, for ``hier_bsp``)."""

    name: str
    seconds: float  # communication time if nothing overlaps it
    exposed_seconds: float  # what stays on the step's critical path
    inter_bytes_per_node: float  # bytes one node sends over its inter-node link
    intra_bytes_per_device: float  # bytes one device sends inside its node
    notes: str = ""


@dataclass(frozen=True)
class Plan:
    """Every technique's estimate for one model on one cluster (``estimates[0]`` is the flat ring)."""

    cluster: Cluster
    gradient_bytes: float
    estimates: list[Estimate] = field(default_factory=list)

    def by_name(self, name: str) -> Estimate:
        return next(e for e in self.estimates if e.name == name)


def ring_seconds(nbytes: float, endpoints: int, bandwidth: float, latency: float, passes: int = 2) -> float:
    """``passes`` = 2 for an all-reduce, 1 for a reduce-scatter or an all-gather."""
    if endpoints <= 1:
        return 0.0
    steps = passes * (endpoints - 1)
    return steps * latency + steps / endpoints * nbytes / bandwidth


def ring_bytes(nbytes: float, endpoints: int, passes: int = 2) -> float:
    return 0.0 if endpoints <= 1 else passes * (endpoints - 1) / endpoints * nbytes


def flat_ring(cluster: Cluster, nbytes: float) -> Estimate:
    """What ``ddp`` does: one ring over all ranks. In node order only one flow per node crosses the
    slow link, but it carries the ring's full per-endpoint volume, so every step runs at its speed."""
    p = cluster.world_size
    inter = ring_bytes(nbytes, p) if cluster.nodes > 1 else 0.0
    slowest = cluster.inter_bandwidth if cluster.nodes > 1 else cluster.intra_bandwidth
    seconds = ring_seconds(nbytes, p, slowest, cluster.latency)
    return Estimate("ddp (flat ring)", seconds, seconds, inter, ring_bytes(nbytes, p))


def hierarchical(
    cluster: Cluster,
    nbytes: float,
    weights: list[float] | None = None,
    hop_ratio: float = 1.0,
    name: str = "",
) -> Estimate:
    """``hier_sliced``: reduce-scatter in the node, all-reduce of each slice across nodes (the node's
    ``L`` slices share its link), all-gather in the node. Unequal ``weights`` change the intra-node
    steps (the largest slice is the slowest) but not the bytes each node sends across; ``hop_ratio`` < 1
    is a compressed inter-node hop (``inter_node_dtype``), which carries that share of the bytes."""
    nodes, local = cluster.nodes, cluster.devices_per_node
    shares = _shares(weights, local)
    largest = max(shares) * nbytes
    intra_rs = _sliced_ring_seconds(largest, local, cluster.intra_bandwidth, cluster.latency)
    hop_bytes = nbytes * hop_ratio
    inter = ring_seconds(hop_bytes, nodes, cluster.inter_bandwidth, cluster.latency)  # all slices, one link
    seconds = 2 * intra_rs + inter
    name = name or ("hier_sliced" if weights is None else "hier_sliced (weighted)")
    return Estimate(
        name, seconds, seconds, ring_bytes(hop_bytes, nodes), 2 * ring_bytes(nbytes, local, passes=1)
    )


def hop_ratio(dtype: str, inter_node_dtype: str) -> float:
    """The share of a ``dtype`` gradient's bytes that ``inter_node_dtype``'s inter-node hop carries:
    ``"bfloat16"`` 2 bytes per element, ``"int8"`` and ``"fp8"`` 1 byte plus one fp32 scale per block
    (:mod:`lightning_hier.sliced.int8_codec`). Never more than the gradients themselves."""
    if inter_node_dtype not in HOP_BYTES:
        raise ValueError(f"inter_node_dtype={inter_node_dtype!r} is not one of {sorted(HOP_BYTES)}.")
    return min(1.0, HOP_BYTES[inter_node_dtype] / DTYPE_BYTES[dtype])


def with_overlap(estimate: Estimate, backward_seconds: float, buckets: int, name: str) -> Estimate:
    """Time-bucketed sync: buckets go out while backward still runs. What stays exposed is the part of
    the communication longer than backward, and at least the last bucket's share (sent after the last
    gradient exists)."""
    if backward_seconds < 0 or buckets < 1:
        raise ValueError(
            f"backward_seconds must be >= 0 and buckets >= 1, got {backward_seconds}, {buckets}."
        )
    exposed = max(estimate.seconds - backward_seconds, estimate.seconds / buckets)
    return Estimate(
        name, estimate.seconds, exposed, estimate.inter_bytes_per_node, estimate.intra_bytes_per_device
    )


def bsp_superstep(
    cluster: Cluster,
    nbytes: float,
    superstep_steps: int,
    step_seconds: float,
    hop_ratio: float = 1.0,
    hop_name: str = "",
) -> Estimate:
    """``hier_bsp``: one push (reduce-scatter + all-reduce) and one pull (all-gather) per superstep,
    run beside the workers' compute; per micro-step the exposed part is what does not fit into the
    ``superstep_steps`` micro-steps of compute. ``hop_ratio`` < 1: the push across nodes compressed
    (``inter_node_dtype`` ``hop_name``), carrying that share of the bytes."""
    if superstep_steps < 1:
        raise ValueError(f"superstep_steps must be >= 1, got {superstep_steps}.")
    per_superstep = hierarchical(cluster, nbytes, None, hop_ratio)
    exposed = max(0.0, per_superstep.seconds - superstep_steps * step_seconds) / superstep_steps
    hop = f", {hop_name} push" if hop_name else ""
    return Estimate(
        f"hier_bsp (superstep_steps={superstep_steps}{hop})", per_superstep.seconds, exposed,
        per_superstep.inter_bytes_per_node, per_superstep.intra_bytes_per_device,
        notes="per superstep; exposed per micro-step",
    )  # fmt: skip


def bandwidth_bound(cluster: Cluster, nbytes: float) -> Estimate:
    """No all-reduce can do better: every node must send ``2 (N - 1) / N * S`` over its link."""
    inter = ring_bytes(nbytes, cluster.nodes)
    seconds = (
        inter / cluster.inter_bandwidth
        if cluster.nodes > 1
        else ring_bytes(nbytes, cluster.devices_per_node) / cluster.intra_bandwidth
    )
    return Estimate("bandwidth bound", seconds, seconds, inter, 0.0, notes="lower bound")


def plan(
    cluster: Cluster,
    params: float,
    dtype: str = "fp32",
    bucket_mb: float = 25.0,
    backward_seconds: float | None = None,
    slice_weights: list[float] | None = None,
    superstep_steps: int = 4,
    step_seconds: float | None = None,
    inter_node_dtype: str | None = None,
    pipeline_stages: Sequence[int] = (),
    micro_batches: int = 4,
    activation_bytes: float | None = None,
) -> Plan:
    """Every technique's predicted communication for a model of ``params`` parameters.

    ``inter_node_dtype`` (``"bfloat16"``, ``"int8"``, ``"fp8"``) adds ``hier_sliced`` and ``hier_bsp`` with
    that compressed hop;
    ``pipeline_stages`` adds a ``hier_pipeline`` row per number of stages (``micro_batches`` each, one
    micro-batch's boundary activation of ``activation_bytes``, compute ``step_seconds`` per device and step:
    :mod:`lightning_hier.plan.pipeline_cost`)."""
    if not (is_real(params) and 0 < params < math.inf):
        raise ValueError(f"params must be positive and finite, got {params!r}.")
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPE_BYTES)}.")
    check_megabytes("bucket_mb", bucket_mb)
    for name, seconds in (("backward_seconds", backward_seconds), ("step_seconds", step_seconds)):
        if seconds is not None and not (is_real(seconds) and 0 <= seconds < math.inf):
            raise ValueError(f"{name} must be a finite number of seconds >= 0, got {seconds!r}.")
    check_integer("superstep_steps", superstep_steps, 1)
    # the compressed hop's share of the bytes; an unknown inter_node_dtype is refused before anything runs
    ratio = hop_ratio(dtype, inter_node_dtype) if inter_node_dtype is not None else None
    if pipeline_stages and (activation_bytes is None or (step_seconds is None and backward_seconds is None)):
        raise ValueError(
            "pricing hier_pipeline needs one micro-batch's activation at a stage boundary (activation_bytes, "
            "--activation-mb) and the compute per step (step_seconds, --step-compute, or backward_seconds)."
        )
    nbytes = float(params) * DTYPE_BYTES[dtype]
    if not math.isfinite(nbytes):
        raise ValueError(f"params={params!r} of {dtype} is beyond floating point ({nbytes} bytes).")
    per_bucket = nbytes / (bucket_mb * 2**20)
    if not math.isfinite(per_bucket):
        raise ValueError(
            f"bucket_mb={bucket_mb!r} is too small: params={params!r} fill {per_bucket} buckets."
        )
    buckets = max(1, math.ceil(per_bucket))
    estimates = [flat_ring(cluster, nbytes), hierarchical(cluster, nbytes)]
    if slice_weights is not None:
        estimates.append(hierarchical(cluster, nbytes, slice_weights))
    if backward_seconds is not None:
        estimates.append(with_overlap(estimates[0], backward_seconds, buckets, "ddp, overlapped buckets"))
        estimates.append(with_overlap(estimates[1], backward_seconds, buckets, "hier_sliced, time buckets"))
    compute = step_seconds if step_seconds is not None else (backward_seconds or 0.0) * 1.5
    if ratio is not None:
        estimates.append(hierarchical(cluster, nbytes, None, ratio, f"hier_sliced, {inter_node_dtype} hop"))
    estimates.append(bsp_superstep(cluster, nbytes, superstep_steps, compute))
    if ratio is not None:
        estimates.append(bsp_superstep(cluster, nbytes, superstep_steps, compute, ratio, inter_node_dtype))
    from lightning_hier.plan.pipeline_cost import pipeline_estimate  # it builds on this module's pieces

    for stages in pipeline_stages:
        assert activation_bytes is not None  # checked above
        estimates.append(pipeline_estimate(cluster, nbytes, stages, micro_batches, activation_bytes, compute))
    estimates.append(bandwidth_bound(cluster, nbytes))
    for e in estimates:  # finite inputs at the edges of float range (1e300 params) may still overflow
        numbers = (e.seconds, e.exposed_seconds, e.inter_bytes_per_node, e.intra_bytes_per_device)
        if not all(map(math.isfinite, numbers)):
            raise ValueError(
                f"params={params!r} on {cluster.nodes} x {cluster.devices_per_node} devices at "
                f"intra_bandwidth={cluster.intra_bandwidth!r}, inter_bandwidth={cluster.inter_bandwidth!r}: "
                f"{e.name} times or bytes beyond floating point."
            )
    return Plan(cluster, nbytes, estimates)


def _shares(weights: list[float] | None, local: int) -> list[float]:
    if weights is None:
        return [1.0 / local] * local
    if len(weights) != local or not all(is_real(w) and 0 < w < math.inf for w in weights):
        raise ValueError(f"slice weights must be {local} positive numbers, got {weights!r}.")
    largest = max(weights)  # scaled first: a sum of weights near the float maximum overflows
    total = sum(w / largest for w in weights)
    return [w / largest / total for w in weights]


def _sliced_ring_seconds(largest_slice: float, endpoints: int, bandwidth: float, latency: float) -> float:
    """A reduce-scatter (or all-gather) whose slowest endpoint handles ``largest_slice`` bytes from each
    of the other ``endpoints - 1``."""
    if endpoints <= 1:
        return 0.0
    return (endpoints - 1) * (latency + largest_slice / bandwidth)
