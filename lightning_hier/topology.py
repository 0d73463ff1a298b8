"""The one description of how processes are laid out: ``num_nodes x devices_per_node``.

Rank ``r`` lives on node ``r // devices_per_node`` with local index ``r % devices_per_node``.
A *node* here is a group of devices joined by a fast link. It usually is a host, but
``devices_per_node`` smaller than the processes per host splits a host into *virtual nodes*
(4 CPU processes as 2 nodes x 2 for development, or the NVLink islands of a big box).

Three kinds of process groups are built from it, and nothing else in the package creates groups:

- ``world``: every rank (plans, flags, statistics: the package's control traffic);
- ``intra``: the ranks of one node (reduce-scatter and all-gather go here, over the fast link);
- ``inter``: the ranks with the same local index on every node (all-reduce goes here, over the slow link).

**The device rule** (DESIGN principle 7). NCCL refuses CPU tensors, and some data here lives on the
host by design (control flags and plans, node-shared embedding tables). So every group the package
issues a collective on has a CPU backend beside the device one: on CUDA the strategies create the
default group as ``"cuda:nccl,cpu:gloo"`` (:func:`resolve_backend`) and :meth:`Topology.build_groups`
builds ``intra``/``inter`` with the same pair, adding ``cpu:gloo`` when a user-made default group
lacks it (then ``world`` is a new all-rank group with the pair). Each tensor then travels where it
lives: device tensors (gradients, parameters, activations) over NCCL, host tensors (control data,
host-resident tables) over gloo, with no copies to satisfy a backend. Every package collective
names one of these groups explicitly; none relies on the default group.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    """A validated ``num_nodes x devices_per_node`` layout of ``world_size`` ranks.

    Build it with :meth:`from_world` (validates and explains bad settings) and call
    :meth:`build_groups` once, on every rank, after the default process group exists.
    """

    world_size: int
    rank: int
    devices_per_node: int
    intra_group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    inter_group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    world_group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        validate_layout(self.world_size, self.devices_per_node)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} is outside [0, world_size={self.world_size}).")

    @classmethod
    def from_world(
        cls, world_size: int, rank: int, devices_per_node: int | None, processes_per_host: int
    ) -> Topology:
        """Resolve ``devices_per_node=None`` to the processes per host, then validate."""
        resolved = processes_per_host if devices_per_node is None else devices_per_node
        return cls(world_size=world_size, rank=rank, devices_per_node=resolved)

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.devices_per_node

    @property
    def node_rank(self) -> int:
        return self.rank // self.devices_per_node

    @property
    def local_rank(self) -> int:
        """This rank's index inside its node; it owns slice ``local_rank`` of every bucket."""
        return self.rank % self.devices_per_node

    def intra_ranks(self, node: int | None = None) -> list[int]:
        """Global ranks of ``node`` (default: this rank's node), in local-index order."""
        node = self.node_rank if node is None else node
        start = node * self.devices_per_node
        return list(range(start, start + self.devices_per_node))

    def inter_ranks(self, local_index: int | None = None) -> list[int]:
        """Global ranks holding ``local_index`` (default: this rank's) on every node, in node order."""
        local_index = self.local_rank if local_index is None else local_index
        return [node * self.devices_per_node + local_index for node in range(self.num_nodes)]

    def build_groups(self, timeout: timedelta | None = None, dedicated: bool = False) -> Topology:
        """Create the world, intra- and inter-node groups (a collective call: every rank must make it).

        Returns a copy of this topology holding this rank's groups, each with a CPU backend beside
        the device one (the device rule above). ``dedicated``: a world group of its own too, instead
        of the shared control group (for a thread that issues collectives beside the main thread's).
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("Topology.build_groups needs torch.distributed to be initialised first.")
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"Topology was made for world_size={self.world_size} but the process group has "
                f"{dist.get_world_size()} ranks."
            )
        backend = host_capable_backend()
        world = dist.new_group(timeout=timeout, backend=backend) if dedicated else control_group(timeout)
        intra_lists = [self.intra_ranks(node) for node in range(self.num_nodes)]
        inter_lists = [self.inter_ranks(index) for index in range(self.devices_per_node)]
        intra, _ = dist.new_subgroups_by_enumeration(intra_lists, timeout=timeout, backend=backend)
        inter, _ = dist.new_subgroups_by_enumeration(inter_lists, timeout=timeout, backend=backend)
        return Topology(
            self.world_size,
            self.rank,
            self.devices_per_node,
            intra_group=intra,
            inter_group=inter,
            world_group=world,
        )

    def describe(self) -> str:
        return (
            f"{self.num_nodes} node(s) x {self.devices_per_node} device(s); rank {self.rank} is "
            f"node {self.node_rank}, local index {self.local_rank}"
        )


def validate_layout(world_size: int, devices_per_node: int) -> None:
    """Raise ``ValueError`` naming the setting when ``world_size`` cannot be split into nodes."""
    if not isinstance(devices_per_node, int) or isinstance(devices_per_node, bool) or devices_per_node < 1:
        raise ValueError(f"devices_per_node must be a positive integer or None, got {devices_per_node!r}.")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}.")
    if world_size % devices_per_node != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"devices_per_node={devices_per_node} does not divide the world size {world_size}; "
            f"valid values are {divisors} (or None for the processes per host)."
        )


# ---------------------------------------------------------------------- nodes and hosts
def gather_hosts() -> list[str]:
    """Every rank's host name, in rank order (a collective over the control group; every rank calls it)."""
    hosts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname(), group=control_group())
    return [str(host) for host in hosts]


def nodes_across_hosts(topology: Topology, hosts: Sequence[str]) -> dict[int, dict[str, list[int]]]:
    """The nodes whose ranks run on more than one host: ``{node: {host: its ranks there}}``.

    Virtual nodes (several on one host) are fine; a node spread over hosts is not what the layout means:
    its "fast" link is then the network, and memory it shares (``HybridEmbedding``'s tables) is not
    shared at all."""
    spread: dict[int, dict[str, list[int]]] = {}
    for node in range(topology.num_nodes):
        by_host: dict[str, list[int]] = {}
        for rank in topology.intra_ranks(node):
            by_host.setdefault(hosts[rank], []).append(rank)
        if len(by_host) > 1:
            spread[node] = by_host
    return spread


def nodes_across_hosts_problem(topology: Topology, hosts: Sequence[str]) -> str | None:
    """``None`` where every node's ranks share a host; else what is wrong and the two ways to fix it."""
    spread = nodes_across_hosts(topology, hosts)
    if not spread:
        return None
    per_host: dict[str, int] = {}
    for host in hosts:
        per_host[host] = per_host.get(host, 0) + 1
    node, by_host = next(iter(spread.items()))
    where = "; ".join(f"ranks {ranks} on {host!r}" for host, ranks in by_host.items())
    low, high = min(per_host.values()), max(per_host.values())
    counts = str(low) if low == high else f"{low} to {high}"
    return (
        f"devices_per_node={topology.devices_per_node} makes node {node} of ranks "
        f"{topology.intra_ranks(node)}, but they run on different hosts ({where}); "
        f"{len(spread)} of {topology.num_nodes} node(s) are spread so. A node's ranks must share a host. "
        f"The hosts run {counts} process(es) each: set devices_per_node to a divisor of that, or, if the "
        "launcher numbered ranks round-robin over the hosts (SLURM --distribution=cyclic), launch them host "
        "by host (--distribution=block), which is Lightning's numbering: rank = node_rank x devices + "
        "local_rank."
    )


# ---------------------------------------------------------------------- the device rule
DEVICE_BACKEND_ENV = "LIGHTNING_HIER_DEVICE_BACKEND"
"""Names the backend that stands for NCCL (default ``nccl``); ``lightning_hier.audit`` sets it to an
emulation so that a CPU run builds its groups exactly as a CUDA run would."""


def device_backend_name() -> str:
    return os.environ.get(DEVICE_BACKEND_ENV, "nccl")


def emulating_cuda() -> bool:
    """True in a CPU run whose groups are built as on CUDA (see :mod:`lightning_hier.audit`)."""
    return device_backend_name() != "nccl"


def runs_as_cuda(device: torch.device) -> bool:
    """Whether a run on ``device`` takes CUDA's choices: on a CUDA device, or in a CPU run emulating one."""
    return device.type == "cuda" or emulating_cuda()


def resolve_backend(device: torch.device, requested: str | None = None) -> str:
    """The default group's backend for a run on ``device``: ``"cuda:nccl,cpu:gloo"`` on CUDA.

    ``requested`` (the strategy's ``process_group_backend``) is kept when given: a plain ``"nccl"``
    then makes an NCCL-only default group, and :meth:`Topology.build_groups` adds a separate
    all-rank group with a CPU backend for the package's own control traffic.
    """
    if requested is not None:
        return requested
    if runs_as_cuda(device):
        return f"cuda:{device_backend_name()},cpu:gloo"
    return "gloo"


def _backend_pairs(group: dist.ProcessGroup | None = None) -> dict[str, str]:
    """``{"cuda": "nccl", "cpu": "gloo"}`` for a group (``dist.get_backend_config``'s string, parsed)."""
    config = dist.get_backend_config(group)
    pairs = {}
    for part in config.split(","):
        if ":" in part:
            device, backend = part.split(":", 1)
            pairs[device.strip()] = backend.strip()
        else:  # a bare name serves every device it supports
            pairs.setdefault("cpu", part.strip())
    return pairs


def host_capable_backend(group: dist.ProcessGroup | None = None) -> str | None:
    """The backend spec for new groups: the default group's, with ``cpu:gloo`` added if it lacks one.

    ``None`` when the default group already serves CPU tensors (new groups then copy it).
    """
    pairs = _backend_pairs(group)
    if "cpu" in pairs:
        return None
    pairs["cpu"] = "gloo"
    return ",".join(f"{device}:{backend}" for device, backend in pairs.items())


_CONTROL_GROUP: list[tuple[dist.ProcessGroup, dist.ProcessGroup]] = []  # (default group, control group)


def control_group(timeout: timedelta | None = None) -> dist.ProcessGroup:
    """All ranks, with a CPU backend: the default group when it has one, else one made once per run.

    A collective call the first time on a default group without a CPU backend (every rank must make it).
    """
    default = dist.group.WORLD
    assert default is not None, "torch.distributed is not initialised"
    if host_capable_backend() is None:
        return default
    if not _CONTROL_GROUP or _CONTROL_GROUP[0][0] is not default:  # none yet, or a new default group
        _CONTROL_GROUP[:] = [(default, dist.new_group(timeout=timeout, backend=host_capable_backend()))]
    return _CONTROL_GROUP[0][1]
