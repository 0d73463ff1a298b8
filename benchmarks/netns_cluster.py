"""Emulate a small multi-node cluster on one Linux host with network namespaces.

Each emulated *node* is a network namespace holding one end of a veth pair; the
other ends are attached to a Linux bridge in the root namespace, so the nodes
share one L2 segment (``10.77.0.0/24`` by default, node ``i`` gets ``.(i+1)``).
Every node's egress is shaped with a token-bucket filter (``tc ... tbf``) on its
in-namespace veth, which emulates a per-node NIC of ``rate_mbit`` Mbit/s.
Processes started in the same namespace reach each other over that namespace's
loopback path, so only *inter-node* traffic crosses the shaped link.

Everything created here carries the name prefix ``lhbench`` and is removed on
exit (also on exceptions and KeyboardInterrupt); leftovers of a crashed earlier
run are removed before a new cluster is built.  Root and iproute2 (``ip``,
``tc``) are required.

Only traffic between the namespaces created here is generated; the addresses
are private to this emulated cluster.

Run ``sudo python benchmarks/netns_cluster.py`` for a self-test that measures
the shaped throughput between node 1 and node 0.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

PREFIX = "lhbench"
BRIDGE = f"{PREFIX}-br"
SUBNET_PREFIX = "10.77.0"
SUBNET_BITS = 24

# Token-bucket parameters.  ``burst`` must hold at least one timer tick worth of
# tokens (rate / HZ; HZ may be as low as 100) or the filter cannot reach its
# configured rate; 1/100 s of traffic (>= 64 KiB, so a full TSO/GSO segment fits)
# gives a stable rate with short bursts.  ``latency`` bounds the queue in front
# of the bucket: 50 ms is enough to avoid tail drops for a few TCP flows (TCP
# small queues keep per-socket backlog low anyway) without large bufferbloat.
BURST_SECONDS = 0.01
MIN_BURST_BYTES = 64 * 1024
LATENCY_MS = 50


@dataclass(frozen=True)
class Node:
    """One emulated node: a network namespace with one shaped veth interface."""

    index: int
    netns: str
    ip: str
    ifname: str
    peer_ifname: str


@dataclass
class EmulatedCluster:
    """Handle to a running emulated cluster (created by :func:`emulated_cluster`)."""

    nodes: list[Node]
    rate_mbit: float
    burst_bytes: int
    latency_ms: int
    bridge: str = BRIDGE
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)

    def exec_argv(self, node: Node, argv: Sequence[str]) -> list[str]:
        """Return ``argv`` wrapped so that it runs inside ``node``'s namespace."""
        return ["ip", "netns", "exec", node.netns, *argv]

    def run(self, node: Node, argv: Sequence[str], check: bool = True) -> str:
        """Run ``argv`` inside ``node``'s namespace, wait, and return its stdout."""
        return _run(self.exec_argv(node, argv), check=check)

    def popen(
        self,
        node: Node,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        **kwargs: object,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside ``node``'s namespace in its own process group.

        The process is tracked and killed (whole process group) when the cluster
        is torn down, if it is still running then.
        """
        proc = subprocess.Popen(  # noqa: S603 - argv is built by the caller, not a shell string
            self.exec_argv(node, argv),
            env=dict(env) if env is not None else None,
            start_new_session=True,
            **kwargs,  # type: ignore[arg-type]
        )
        self._procs.append(proc)
        return proc

    def tx_bytes(self, node: Node) -> int:
        """Bytes sent so far by ``node``'s veth, read from sysfs inside its namespace."""
        path = f"/sys/class/net/{node.ifname}/statistics/tx_bytes"
        return int(self.run(node, ["cat", path]).strip())

    def tx_bytes_all(self) -> list[int]:
        """``tx_bytes`` of every node, in node order."""
        return [self.tx_bytes(node) for node in self.nodes]

    def kill_processes(self, grace_s: float = 5.0) -> None:
        """Terminate (then kill) every still-running process started via :meth:`popen`."""
        alive = [p for p in self._procs if p.poll() is None]
        for proc in alive:
            _signal_group(proc, 15)
        deadline = time.monotonic() + grace_s
        for proc in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            if proc.poll() is None:
                _signal_group(proc, 9)
                proc.wait()
        self._procs.clear()


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Send ``sig`` to the process group led by ``proc`` (created with start_new_session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _run(argv: Sequence[str], check: bool = True) -> str:
    """Run a command, return stdout; raise with stderr included when ``check`` fails."""
    res = subprocess.run(list(argv), capture_output=True, text=True)  # noqa: S603
    if check and res.returncode != 0:
        raise RuntimeError(f"command failed ({res.returncode}): {' '.join(argv)}\n{res.stderr.strip()}")
    return res.stdout


def require_tools() -> None:
    """Fail early with a clear message when not root or when iproute2 is missing."""
    if os.geteuid() != 0:
        raise PermissionError("network namespaces need root: run with sudo")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise FileNotFoundError(f"missing {missing}: install iproute2 (apt-get install -y iproute2)")


def burst_bytes_for(rate_mbit: float) -> int:
    """Token-bucket size for ``rate_mbit``: ``BURST_SECONDS`` of traffic, at least ``MIN_BURST_BYTES``."""
    return max(MIN_BURST_BYTES, int(rate_mbit * 1e6 / 8 * BURST_SECONDS))


def list_stale_netns(prefix: str = PREFIX) -> list[str]:
    """Names of existing network namespaces that start with ``prefix``."""
    out = _run(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [name for name in names if name.startswith(prefix)]


def list_stale_links(prefix: str = PREFIX) -> list[str]:
    """Names of root-namespace links that start with ``prefix`` (bridge, veth peers)."""
    out = _run(["ip", "-o", "link", "show"], check=False)
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return [name for name in names if name.startswith(prefix)]


def cleanup(prefix: str = PREFIX) -> None:
    """Remove every namespace and root-namespace link whose name starts with ``prefix``.

    Deleting a namespace destroys the veth end inside it, which also destroys
    its peer; remaining links (bridge, orphaned peers) are deleted explicitly.
    Errors are ignored so that cleanup is idempotent.
    """
    for netns in list_stale_netns(prefix):
        _run(["ip", "netns", "del", netns], check=False)
    for link in list_stale_links(prefix):
        _run(["ip", "link", "del", link], check=False)


def _make_node(index: int, subnet_prefix: str, name_prefix: str = PREFIX) -> Node:
    """Names and address for node ``index`` (interface names stay below 16 characters)."""
    return Node(
        index=index,
        netns=f"{name_prefix}-n{index}",
        ip=f"{subnet_prefix}.{index + 1}",
        ifname=f"{name_prefix}-e{index}",
        peer_ifname=f"{name_prefix}-v{index}",
    )


def _create_bridge(bridge: str) -> None:
    """Create the root-namespace bridge that connects all nodes."""
    _run(["ip", "link", "add", bridge, "type", "bridge"])
    _run(["ip", "link", "set", bridge, "up"])


def _create_node(node: Node, bridge: str, rate_mbit: float, burst: int, latency_ms: int) -> None:
    """Create ``node``'s namespace, veth pair, address and egress shaping."""
    ns = ["ip", "netns", "exec", node.netns]
    _run(["ip", "netns", "add", node.netns])
    _run(["ip", "link", "add", node.ifname, "type", "veth", "peer", "name", node.peer_ifname])
    _run(["ip", "link", "set", node.ifname, "netns", node.netns])
    _run(["ip", "link", "set", node.peer_ifname, "master", bridge])
    _run(["ip", "link", "set", node.peer_ifname, "up"])
    _run([*ns, "ip", "link", "set", "lo", "up"])
    _run([*ns, "ip", "addr", "add", f"{node.ip}/{SUBNET_BITS}", "dev", node.ifname])
    _run([*ns, "ip", "link", "set", node.ifname, "up"])
    _run(
        [
            *ns,
            "tc",
            "qdisc",
            "add",
            "dev",
            node.ifname,
            "root",
            "tbf",
            "rate",
            f"{rate_mbit}mbit",
            "burst",
            str(burst),
            "latency",
            f"{latency_ms}ms",
        ]
    )


def _wait_reachable(cluster: EmulatedCluster, timeout_s: float = 10.0) -> None:
    """Wait until node 0 answers a ping from every other node (bridge ports need a moment)."""
    deadline = time.monotonic() + timeout_s
    target = cluster.nodes[0].ip
    for node in cluster.nodes[1:]:
        while True:
            ok = (
                subprocess.run(
                    cluster.exec_argv(node, ["ping", "-c", "1", "-W", "1", target]),
                    capture_output=True,
                ).returncode
                == 0
            )
            if ok:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{node.netns} cannot reach {target}")
            time.sleep(0.2)


@contextlib.contextmanager
def emulated_cluster(
    num_nodes: int = 2,
    rate_mbit: float = 200,
    latency_ms: int = LATENCY_MS,
    burst_bytes: int | None = None,
    subnet_prefix: str = SUBNET_PREFIX,
    name_prefix: str = PREFIX,
) -> Iterator[EmulatedCluster]:
    """Build an emulated ``num_nodes`` cluster with ``rate_mbit`` egress per node; tear it down on exit.

    Args:
        num_nodes: number of namespaces ("nodes"), at most 250.
        rate_mbit: egress rate limit of each node's veth, in Mbit/s.
        latency_ms: tbf ``latency`` (maximum queueing delay before drops).
        burst_bytes: tbf ``burst``; default :func:`burst_bytes_for` ``(rate_mbit)``.
        subnet_prefix: first three octets of the private /24 used for the nodes.
        name_prefix: prefix of every namespace and link created (and of what is cleaned up), so
            that benchmarks with different prefixes do not remove each other's clusters; at most
            12 characters (interface names must stay below 16).

    Yields:
        An :class:`EmulatedCluster` describing the nodes.
    """
    require_tools()
    if not 1 <= num_nodes <= 250:
        raise ValueError(f"num_nodes must be in [1, 250], got {num_nodes}")
    if not name_prefix or len(name_prefix) > 12 or not name_prefix.replace("-", "").isalnum():
        raise ValueError(f"name_prefix must be 1-12 characters [A-Za-z0-9-], got {name_prefix!r}")
    burst = burst_bytes if burst_bytes is not None else burst_bytes_for(rate_mbit)
    nodes = [_make_node(i, subnet_prefix, name_prefix) for i in range(num_nodes)]
    cluster = EmulatedCluster(
        nodes=nodes,
        rate_mbit=rate_mbit,
        burst_bytes=burst,
        latency_ms=latency_ms,
        bridge=f"{name_prefix}-br",
    )
    cleanup(name_prefix)
    try:
        _create_bridge(cluster.bridge)
        for node in nodes:
            _create_node(node, cluster.bridge, rate_mbit, burst, latency_ms)
        if shutil.which("ping"):
            _wait_reachable(cluster)
        yield cluster
    finally:
        try:
            cluster.kill_processes()
        finally:
            cleanup(name_prefix)


_SINK = """
import socket, sys
srv = socket.create_server(("0.0.0.0", int(sys.argv[1])))
conn, _ = srv.accept()
total = 0
while chunk := conn.recv(1 << 20):
    total += len(chunk)
print(total)
"""

_SOURCE = """
import socket, sys, time
host, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for _ in range(100):
    try:
        s = socket.create_connection((host, port))
        break
    except OSError:
        time.sleep(0.05)
buf = b"x" * (1 << 20)
t0 = time.perf_counter()
sent = 0
while sent < nbytes:
    s.sendall(buf)
    sent += len(buf)
s.shutdown(socket.SHUT_WR)
s.recv(1)
print(time.perf_counter() - t0)
"""


def self_test(rate_mbit: float = 200, megabytes: int = 50) -> None:
    """Send ``megabytes`` MiB from node 1 to node 0 over TCP and print the achieved rate."""
    with emulated_cluster(num_nodes=2, rate_mbit=rate_mbit) as cluster:
        src, dst = cluster.nodes[1], cluster.nodes[0]
        nbytes = megabytes << 20
        sink = cluster.popen(dst, [sys.executable, "-c", _SINK, "5201"], stdout=subprocess.PIPE)
        tx0 = cluster.tx_bytes(src)
        out = cluster.run(src, [sys.executable, "-c", _SOURCE, dst.ip, "5201", str(nbytes)])
        tx1 = cluster.tx_bytes(src)
        received = int(sink.communicate(timeout=30)[0])
        seconds = float(out)
        print(f"nodes: {[(n.netns, n.ip, n.ifname) for n in cluster.nodes]}")
        print(f"tbf: rate {rate_mbit} mbit, burst {cluster.burst_bytes} B, latency {cluster.latency_ms} ms")
        mbit = received * 8 / seconds / 1e6
        print(f"payload {received / 1e6:.1f} MB in {seconds:.2f} s = {mbit:.1f} Mbit/s")
        print(f"tx_bytes delta {(tx1 - tx0) / 1e6:.1f} MB (= payload x {(tx1 - tx0) / received:.3f})")
    print(f"leftovers after cleanup: netns={list_stale_netns()} links={list_stale_links()}")


if __name__ == "__main__":
    self_test(rate_mbit=float(sys.argv[1]) if len(sys.argv) > 1 else 200)
