"""The one description of how processes are laid out: ``num_nodes x devices_per_node``.

Rank ``r`` lives on node ``r // devices_per_node`` with local index ``r % devices_per_node``.
A *node* here is a group of devices joined by a fast link. It usually is a host, but
``devices_per_node`` smaller than the processes per host splits a host into *virtual nodes*
(4 CPU processes as 2 nodes x 2 for development, or the NVLink islands of a big box).

Three kinds of process groups are built from it, and nothing else in the package creates groups:

- ``world``: every rank (plans, flags, statistics: the package's control traffic);
- ``intra``: the ranks of one node (reduce-scatter and all-gather go here, over the fast link);
- ``inter``: the ranks with the same local index on every node (all-reduce goes here, over the slow link).

Besides these, :func:`control_group` (all ranks, host data only) and :func:`subset_group` (the ranks of
one set, such as the pipeline stages holding a tied parameter).

**Built once per process.** Every group is kept in a registry keyed by what it is for (the shared set
of the training thread, or a dedicated set named after the thread that issues on it, such as ``"bsp"``
or ``"tables"``), its role, backend, timeout and member ranks. A second fit, a Tuner's fit or a
validation run gets the groups the first one built; on a GPU each group is an NCCL communicator
(memory, connections, start-up time), so a new one per fit would pile up. The registry belongs to the
default group it was built on: once that is destroyed (``dist.destroy_process_group()`` destroys every
group, by the user or at exit) the next request starts a fresh registry on the new default group.
:mod:`lightning_hier.strategies.process_group_exit` empties it and destroys the default group, and with
it every group here, at interpreter exit. A group built without a timeout gets the default group's, so
the strategy's ``timeout`` reaches every group and a stuck NCCL collective is ended after it.

**The device rule**. NCCL refuses CPU tensors, and some data here lives on the
host by design (control flags and plans, node-shared embedding tables). So every group the package
issues a collective on has a CPU backend: on CUDA the strategies create the default group as
``"cuda:nccl,cpu:gloo"`` (:func:`resolve_backend`) and :meth:`Topology.build_groups` builds
``intra``/``inter`` with the same pair, adding ``cpu:gloo`` when a user-made default group lacks it
(then ``world`` is a new all-rank group with the pair, :func:`all_ranks_group`). Each tensor then
travels where it lives: device tensors (gradients, parameters, activations) over NCCL, host tensors
(control data, host-resident tables) over gloo, with no copies to satisfy a backend. A group that only
ever carries host data is built as ``"gloo"`` alone, with no NCCL communicator behind it:
:func:`control_group` when the default group lacks a CPU backend, the BSP thread's ``world`` (its
control rows and counts) and the ``HybridEmbedding`` tables' exchange groups (sparse gradients of host
tables). Every package collective names one of these groups explicitly; none relies on the default
group.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

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

    def build_groups(
        self,
        timeout: timedelta | None = None,
        dedicated: bool | str = False,
        *,
        host_only: Collection[str] = (),
    ) -> Topology:
        """The world, intra- and inter-node groups (a collective call the first time: every rank makes it).

        Returns a copy of this topology holding this rank's groups, each with a CPU backend beside
        the device one (the device rule above), built once per process and default group and reused
        by later calls. ``timeout``: the groups' (``None``: the default group's). ``dedicated``: the
        training thread's shared set when false; a name (``"bsp"``, ``"tables"``) for the set of its own
        that a thread issuing collectives beside the main thread's uses, the same set for every call with
        that name; ``True`` for a new unnamed set on every call. ``host_only``: the roles among
        ``"world"``, ``"intra"``, ``"inter"`` that only ever carry host tensors, built as ``"gloo"`` alone.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("Topology.build_groups needs torch.distributed to be initialised first.")
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"Topology was made for world_size={self.world_size} but the process group has "
                f"{dist.get_world_size()} ranks."
            )
        unknown = set(host_only) - {"world", "intra", "inter"}
        if unknown:
            raise ValueError(f"host_only names roles 'world', 'intra', 'inter'; got {sorted(unknown)}.")
        if dedicated is True:
            purpose: str | None = None  # a new set, kept by the caller only
        elif dedicated is False:
            purpose = SHARED
        elif isinstance(dedicated, str) and dedicated and dedicated != SHARED:
            purpose = dedicated
        else:
            raise ValueError(f"dedicated must be a bool or the name of a thread's groups, got {dedicated!r}.")

        def backend(role: str) -> str | None:
            return "gloo" if role in host_only else host_capable_backend()

        if purpose == SHARED and "world" not in host_only:
            world = all_ranks_group(timeout)
        elif purpose == SHARED:
            world = control_group(timeout)
        else:
            world = _registered_group(range(self.world_size), purpose, "world", backend("world"), timeout)
        intra_lists = [self.intra_ranks(node) for node in range(self.num_nodes)]
        inter_lists = [self.inter_ranks(index) for index in range(self.devices_per_node)]
        intra = _subgroup_of(self.rank, intra_lists, purpose, "intra", backend("intra"), timeout)
        inter = _subgroup_of(self.rank, inter_lists, purpose, "inter", backend("inter"), timeout)
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


# ---------------------------------------------------------------------- the package's groups
SHARED = "shared"
"""The purpose of the groups the training thread issues on (:meth:`Topology.build_groups` without
``dedicated``, :func:`control_group`, :func:`all_ranks_group`, :func:`subset_group`)."""


@dataclass
class _GroupRegistry:
    """The package's groups on one default group: ``(purpose, role, backend, timeout, ranks) -> group``
    (``GroupMember.NON_GROUP_MEMBER`` where this rank is not a member, so every rank knows the same keys)."""

    default: dist.ProcessGroup | None = None
    groups: dict[tuple, Any] = field(default_factory=dict)


_REGISTRY = _GroupRegistry()


def _live_registry() -> dict[tuple, Any]:
    """The registry of the current default group; a fresh one when the default group changed.

    ``dist.destroy_process_group()`` destroys every group, so groups kept from an earlier default group
    are dead: they are dropped (not destroyed again) once another default group is in use."""
    if not dist.is_available() or not dist.is_initialized():
        forget_groups()
        raise RuntimeError("lightning_hier's process groups need torch.distributed to be initialised first.")
    default = dist.group.WORLD
    if _REGISTRY.default is not default:
        _REGISTRY.groups.clear()
        _REGISTRY.default = default
    return _REGISTRY.groups


def forget_groups() -> None:
    """Empty the registry (at exit, where the default group and with it every group is destroyed)."""
    _REGISTRY.groups.clear()
    _REGISTRY.default = None


def registered_groups() -> list[dist.ProcessGroup]:
    """This rank's groups in the registry of the current default group (none when it is not initialised)."""
    if not dist.is_available() or not dist.is_initialized() or _REGISTRY.default is not dist.group.WORLD:
        return []
    return [g for g in _REGISTRY.groups.values() if isinstance(g, dist.ProcessGroup)]


def default_group_timeout() -> timedelta | None:
    """The timeout the default group was created with (the strategy's ``timeout`` under Lightning)."""
    # read from the backends' options: gloo's on CPU (tested); ProcessGroupNCCL's options carry the same
    # ``_timeout``, which its watchdog uses, but a CPU run cannot show that (docs/gpu.md)
    default = dist.group.WORLD
    for device in getattr(default, "_device_types", ()):
        try:
            timeout = default._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):  # a backend without options (a third-party one)
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return None


def _registered_group(
    ranks: Iterable[int], purpose: str | None, role: str, backend: str | None, timeout: timedelta | None
) -> Any:
    """The group of ``ranks`` for ``(purpose, role)``, built on the first request (``dist.new_group``: a
    collective of all ranks, which all make the same requests in the same order); ``purpose=None``
    builds a new group that is not kept. ``NON_GROUP_MEMBER`` on a rank outside ``ranks``."""
    groups = _live_registry()
    members = tuple(sorted(ranks))
    timeout = timeout if timeout is not None else default_group_timeout()
    key = (purpose, role, backend, timeout, members)
    if purpose is not None and key in groups:
        return groups[key]
    description = f"lightning_hier:{purpose or 'unnamed'}:{role}"
    group = dist.new_group(list(members), timeout=timeout, backend=backend, group_desc=description)
    if purpose is not None:
        groups[key] = group
    return group


def _subgroup_of(
    rank: int,
    rank_lists: Sequence[Sequence[int]],
    purpose: str | None,
    role: str,
    backend: str | None,
    timeout: timedelta | None,
) -> dist.ProcessGroup:
    """One group per list (every rank builds each, in list order), this rank's returned: as
    ``dist.new_subgroups_by_enumeration`` does, with each group kept in the registry."""
    mine = None
    for ranks in rank_lists:
        group = _registered_group(ranks, purpose, role, backend, timeout)
        if rank in ranks:
            mine = group
    assert mine is not None, f"rank {rank} is in none of {rank_lists}"
    return mine


def control_group(timeout: timedelta | None = None) -> dist.ProcessGroup:
    """All ranks, for host data only: the default group when it has a CPU backend, else a ``"gloo"``
    group built once per default group (a collective call then: every rank makes it).

    ``timeout``: of that group (``None``: the default group's)."""
    default = dist.group.WORLD
    assert default is not None, "torch.distributed is not initialised"
    if host_capable_backend() is None:
        return default
    return _registered_group(range(dist.get_world_size()), SHARED, "control", "gloo", timeout)


def all_ranks_group(timeout: timedelta | None = None) -> dist.ProcessGroup:
    """All ranks, for device and host tensors: the default group when it has a CPU backend, else one with
    its device backend and ``cpu:gloo`` built once per default group (a collective call then)."""
    default = dist.group.WORLD
    assert default is not None, "torch.distributed is not initialised"
    backend = host_capable_backend()
    if backend is None:
        return default
    return _registered_group(range(dist.get_world_size()), SHARED, "world", backend, timeout)


def subset_group(ranks: Sequence[int], timeout: timedelta | None = None, role: str = "subset") -> Any:
    """The training thread's group of ``ranks`` with a CPU backend beside the device one, built once per
    default group, ``role`` and set of ranks (a collective of all ranks the first time, members or not;
    ``GroupMember.NON_GROUP_MEMBER`` on the others)."""
    return _registered_group(ranks, SHARED, role, host_capable_backend(), timeout)
