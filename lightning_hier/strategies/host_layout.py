"""Whether each node of a strategy's layout runs on one host, checked once the process group exists.

``devices_per_node`` larger than the processes a host runs, or a launcher that numbers ranks round-robin
over the hosts (SLURM's ``--distribution=cyclic``), puts one node's ranks on several hosts. The job still
computes the right result, but its "fast" in-node link is then the network, which is what the hierarchy
is for; memory a node shares (``HybridEmbedding``'s tables) cannot be shared at all.
"""

from __future__ import annotations

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_hier.topology import Topology, gather_hosts, nodes_across_hosts_problem


def warn_if_nodes_span_hosts(topology: Topology, strategy: str) -> str | None:
    """Gather every rank's host (a collective: every rank calls it) and warn on rank 0 where a node spans
    hosts; returns that problem (the same on every rank), or ``None``."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    problem = nodes_across_hosts_problem(topology, gather_hosts())
    if problem is not None:
        rank_zero_warn(
            f"{strategy}: {problem} Until then the job runs, but its in-node traffic crosses the network.",
            category=UserWarning,
        )
    return problem
