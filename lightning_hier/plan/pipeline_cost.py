"""What ``hier_pipeline`` costs per step for ``S`` stages x ``R = W / S`` replicas, before a job runs.

A pipeline trades gradient traffic and memory for idle time and activation traffic:

- **Replica all-reduce.** Each stage holds ``1/S`` of the parameters and averages their gradients over its
  ``R`` replicas (one flat ring per stage). The ranks of one replica are contiguous (docs/hier_pipeline.md),
  so for ``S >= L`` devices per node the replicas of a stage sit on ``R`` different nodes and a node's link
  carries the rings of its ``L`` stages; for ``S < L`` a node holds whole replicas and its link carries the
  rings of all ``S`` stages (other layouts are counted rank by rank). Its start waits for the last
  micro-batch's backward, so at most that micro-batch's backward hides it.
- **Bubble.** Under 1F1B with ``M`` micro-batches a step takes ``(M + S - 1) / M`` of the compute: ``S - 1``
  micro-batch slots idle while the pipeline fills and drains.
- **Activations.** Every stage boundary carries each micro-batch's activation forward and its gradient back.
  Filling and draining put ``2 (S - 1)`` of those sends on the critical path; when one send takes longer than
  a micro-batch's compute on a stage, the link bounds the whole step instead. A boundary crosses nodes where
  a replica spans several (``S > L``).

``step_seconds`` is one device's forward + backward of its batch under ``ddp`` (the same global batch on
``W`` devices): each stage of a replica then computes ``step_seconds / M`` per micro-batch.
"""

from __future__ import annotations

import math

from lightning_hier.checks import check_integer, is_real
from lightning_hier.plan.cost_model import Cluster, Estimate, ring_bytes, ring_seconds

BACKWARD_SHARE = 2 / 3  # of a micro-batch's compute: backward is about twice the forward


def pipeline_estimate(
    cluster: Cluster,
    nbytes: float,
    stages: int,
    micro_batches: int,
    activation_bytes: float,
    step_seconds: float,
) -> Estimate:
    """``hier_pipeline(stages=S)`` on the whole cluster: replica all-reduce, bubble and activation sends.

    ``nbytes`` are the whole model's gradient bytes, ``activation_bytes`` one micro-batch's activation at a
    stage boundary. ``seconds`` is the communication, ``exposed_seconds`` adds the bubble (idle time a step
    pays on top of ``ddp``'s compute), so the row compares with ``ddp``'s exposed communication."""
    world = cluster.world_size
    check_integer("stages", stages, 1)
    check_integer("micro_batches", micro_batches, 1)
    if world % stages:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(f"stages={stages} does not divide the world size {world}; choose one of {divisors}.")
    for name, value in (("activation_bytes", activation_bytes), ("step_seconds", step_seconds)):
        if not (is_real(value) and 0 <= value < math.inf):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")
    replicas = world // stages
    stage_bytes = nbytes / stages
    micro_compute = step_seconds / micro_batches

    ring_out = _replica_ring_bytes_leaving_each_node(cluster, stages, ring_bytes(stage_bytes, replicas))
    if any(ring_out):
        steps = 2 * (replicas - 1)
        all_reduce = steps * cluster.latency + max(ring_out) / cluster.inter_bandwidth
    else:
        all_reduce = ring_seconds(stage_bytes, replicas, cluster.intra_bandwidth, cluster.latency)
    all_reduce_exposed = max(0.0, all_reduce - BACKWARD_SHARE * micro_compute)

    activation_out = _boundary_bytes_leaving_each_node(cluster, stages, micro_batches * activation_bytes)
    sends = [  # one micro-batch's activation over each boundary of replica 0, the link it crosses
        cluster.latency + activation_bytes / bandwidth for bandwidth in _boundary_bandwidths(cluster, stages)
    ]
    fill_and_drain = 2 * sum(sends)  # the critical path crosses every boundary once each way
    slowest = max(sends, default=0.0)
    link_bound = micro_batches * max(0.0, 2 * slowest - micro_compute)  # both directions share one boundary
    activations_exposed = fill_and_drain + link_bound
    activations_total = 2 * micro_batches * sum(sends)

    bubble = (stages - 1) / micro_batches * step_seconds
    notes = (
        f"{replicas} replica(s); exposed: bubble {bubble * 1e3:.3g} ms, activations "
        f"{activations_exposed * 1e3:.3g} ms, replica all-reduce {all_reduce_exposed * 1e3:.3g} ms; "
        f"1/{stages} of the parameters per device"
    )
    intra = ring_bytes(stage_bytes, replicas) + (2 * micro_batches * activation_bytes if stages > 1 else 0.0)
    return Estimate(
        f"hier_pipeline (stages={stages})",
        all_reduce + activations_total,
        bubble + activations_exposed + all_reduce_exposed,
        max(a + r for a, r in zip(activation_out, ring_out)),
        intra,
        notes=notes,
    )


def stage_rank(replica: int, stage: int, stages: int) -> int:
    """The rank of stage ``stage`` of replica ``replica`` (the layout ``hier_pipeline`` uses)."""
    return replica * stages + stages - 1 - stage


def _replica_ring_bytes_leaving_each_node(cluster: Cluster, stages: int, per_endpoint: float) -> list[float]:
    """Bytes each node sends over its link for the stages' replica rings: an endpoint sends
    ``per_endpoint`` to the next replica of its stage (in rank order, the last to the first), which crosses
    the link where that replica is on another node."""
    local, replicas = cluster.devices_per_node, cluster.world_size // stages
    out = [0.0] * cluster.nodes
    if replicas == 1:
        return out
    for stage in range(stages):
        for replica in range(replicas):
            here = stage_rank(replica, stage, stages) // local
            there = stage_rank((replica + 1) % replicas, stage, stages) // local
            if here != there:
                out[here] += per_endpoint
    return out


def _boundary_bandwidths(cluster: Cluster, stages: int) -> list[float]:
    """The bandwidth of each of a replica's ``stages - 1`` boundaries: the node's link where its two ranks
    are on different nodes, else the fast link inside the node (every replica's layout is alike)."""
    local = cluster.devices_per_node
    return [
        cluster.inter_bandwidth if rank // local != (rank + 1) // local else cluster.intra_bandwidth
        for rank in range(stages - 1)
    ]


def _boundary_bytes_leaving_each_node(cluster: Cluster, stages: int, per_boundary: float) -> list[float]:
    """Bytes each node sends over its link for the activations: across a boundary between neighbouring
    ranks on different nodes, one sends the forwards (``per_boundary`` per step) and the other the
    gradients."""
    local = cluster.devices_per_node
    out = [0.0] * cluster.nodes
    for first in range(0, cluster.world_size, stages):  # each replica's contiguous ranks
        for rank in range(first, first + stages - 1):
            if rank // local != (rank + 1) // local:
                out[rank // local] += per_boundary
                out[(rank + 1) // local] += per_boundary
    return out
