"""An emulated multi-node cluster on one Linux host (root, iproute2), and workers run in it.

A node is a network namespace with one end of a veth pair; the other ends join a bridge in the root
namespace (one L2 segment, ``10.77.0.0/24`` by default, node ``i`` at ``.(i+1)``). A token-bucket
filter (``tc ... tbf``) on each in-namespace veth emulates a per-node NIC of ``rate_mbit`` Mbit/s;
processes in one namespace talk over its loopback, so only inter-node traffic crosses the shaped link.
Everything carries a name prefix (``lhbench``), leftovers of a crashed run are removed first, and all
is removed on exit, exception or Ctrl-C. ``sudo python benchmarks/run.py netns [RATE_MBIT]`` checks it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .jobs import REPO_ROOT, Markers, exit_on_sigterm, flags, job_dir, tail, worker_env

PREFIX = "lhbench"
SUBNET_PREFIX = "10.77.0"
SUBNET_BITS = 24
# Token-bucket parameters. ``burst`` must hold at least one timer tick worth of tokens (rate / HZ; HZ
# may be as low as 100) or the filter cannot reach its configured rate; 1/100 s of traffic (>= 64 KiB,
# so a full TSO/GSO segment fits) gives a stable rate with short bursts. ``latency`` bounds the queue
# in front of the bucket: 50 ms is enough to avoid tail drops for a few TCP flows (TCP small queues
# keep per-socket backlog low anyway) without large bufferbloat.
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
    bridge: str = f"{PREFIX}-br"
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)

    def exec_argv(self, node: Node, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped so that it runs inside ``node``'s namespace."""
        return ["ip", "netns", "exec", node.netns, *argv]

    def run(self, node: Node, argv: Sequence[str], check: bool = True) -> str:
        """Run ``argv`` inside ``node``'s namespace, wait, and return its stdout."""
        return _run(self.exec_argv(node, argv), check=check)

    def popen(
        self, node: Node, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: object
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside ``node``'s namespace in its own process group; it is killed (the
        whole group) when the cluster is torn down, if it still runs then."""
        proc = subprocess.Popen(  # noqa: S603 - argv is built by the caller, not a shell string
            self.exec_argv(node, argv),
            env=dict(env) if env is not None else None,
            start_new_session=True,
            **kwargs,  # type: ignore[arg-type]
        )
        self._procs.append(proc)
        return proc

    def pids(self) -> list[int]:
        """Process ids of everything started via :meth:`popen` that still runs."""
        return [p.pid for p in self._procs if p.poll() is None]

    def tx_bytes(self, node: Node) -> int:
        """Bytes sent so far by ``node``'s veth, read from sysfs inside its namespace."""
        return int(self.run(node, ["cat", f"/sys/class/net/{node.ifname}/statistics/tx_bytes"]).strip())

    def describe(self, ranks_per_node: int) -> str:
        """The cluster in one line."""
        shape = f"{len(self.nodes)} nodes x {ranks_per_node} rank(s), {self.rate_mbit:g} Mbit/s out per node"
        return f"emulated cluster: {shape} (tbf burst {self.burst_bytes} B, latency {self.latency_ms} ms)"

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


def list_stale(prefix: str = PREFIX) -> tuple[list[str], list[str]]:
    """Existing network namespaces, and root-namespace links (bridge, veth peers), named ``prefix*``."""
    netns = [line.split()[0] for line in _run(["ip", "netns", "list"], check=False).split("\n") if line]
    parts = [line.split(":", 2) for line in _run(["ip", "-o", "link", "show"], check=False).splitlines()]
    links = [p[1].strip().split("@")[0] for p in parts if len(p) >= 2]
    return [n for n in netns if n.startswith(prefix)], [n for n in links if n.startswith(prefix)]


def cleanup(prefix: str = PREFIX) -> None:
    """Remove every namespace and root-namespace link whose name starts with ``prefix``.

    Deleting a namespace destroys the veth end inside it, which also destroys its peer; remaining
    links (bridge, orphaned peers) are deleted explicitly. Errors are ignored (idempotent).
    """
    netns, links = list_stale(prefix)
    for name in netns:
        _run(["ip", "netns", "del", name], check=False)
    for name in links:
        _run(["ip", "link", "del", name], check=False)


def _make_node(index: int, subnet_prefix: str, name_prefix: str) -> Node:
    """Names and address for node ``index`` (interface names stay below 16 characters)."""
    netns, ifname, peer_ifname = (f"{name_prefix}-{kind}{index}" for kind in "nev")
    return Node(index, netns, f"{subnet_prefix}.{index + 1}", ifname, peer_ifname)


def _create_node(node: Node, bridge: str, rate_mbit: float, burst: int, latency_ms: int) -> None:
    """Create ``node``'s namespace, veth pair, address and egress shaping."""
    in_root = [
        f"ip netns add {node.netns}",
        f"ip link add {node.ifname} type veth peer name {node.peer_ifname}",
        f"ip link set {node.ifname} netns {node.netns}",
        f"ip link set {node.peer_ifname} master {bridge}",
        f"ip link set {node.peer_ifname} up",
    ]
    in_node = [
        "ip link set lo up",
        f"ip addr add {node.ip}/{SUBNET_BITS} dev {node.ifname}",
        f"ip link set {node.ifname} up",
        f"tc qdisc add dev {node.ifname} root tbf rate {rate_mbit}mbit burst {burst} latency {latency_ms}ms",
    ]
    for command in in_root:
        _run(command.split())
    for command in in_node:
        _run(["ip", "netns", "exec", node.netns, *command.split()])


def _wait_reachable(cluster: EmulatedCluster, timeout_s: float = 10.0) -> None:
    """Wait until node 0 answers a ping from every other node (bridge ports need a moment)."""
    deadline = time.monotonic() + timeout_s
    target = cluster.nodes[0].ip
    for node in cluster.nodes[1:]:
        ping = cluster.exec_argv(node, ["ping", "-c", "1", "-W", "1", target])
        while subprocess.run(ping, capture_output=True).returncode != 0:
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
    """An emulated cluster of ``num_nodes`` (<= 250) nodes with ``rate_mbit`` egress each (tbf ``latency``
    and ``burst``, default :func:`burst_bytes_for`), torn down on exit. ``name_prefix`` (<= 12 characters:
    interface names stay below 16) names, and limits the clean-up to, what it creates, so benchmarks
    with different prefixes (and ``subnet_prefix``, the /24's first three octets) can run side by side."""
    require_tools()
    if not 1 <= num_nodes <= 250:
        raise ValueError(f"num_nodes must be in [1, 250], got {num_nodes}")
    if not name_prefix or len(name_prefix) > 12 or not name_prefix.replace("-", "").isalnum():
        raise ValueError(f"name_prefix must be 1-12 characters [A-Za-z0-9-], got {name_prefix!r}")
    burst = burst_bytes if burst_bytes is not None else burst_bytes_for(rate_mbit)
    nodes = [_make_node(i, subnet_prefix, name_prefix) for i in range(num_nodes)]
    cluster = EmulatedCluster(nodes, rate_mbit, burst, latency_ms, bridge=f"{name_prefix}-br")
    cleanup(name_prefix)
    try:
        _run(["ip", "link", "add", cluster.bridge, "type", "bridge"])
        _run(["ip", "link", "set", cluster.bridge, "up"])
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


def run_on_cluster(body: Callable[[EmulatedCluster], bool], **cluster_options: Any) -> int:
    """Build an emulated cluster (:func:`emulated_cluster` with ``cluster_options``), run ``body`` in it,
    tear it down; returns an exit code: 0 when ``body`` returned True, 1 when not, 130 on Ctrl-C."""
    exit_on_sigterm()
    try:
        with emulated_cluster(**cluster_options) as cluster:
            ok = body(cluster)
    except KeyboardInterrupt:
        print("\ninterrupted; workers stopped and emulated cluster removed", file=sys.stderr)
        return 130
    return 0 if ok else 1


# ---------------------------------------------------------------------- workers in the cluster
def rank_env(
    cluster: EmulatedCluster, node: Node, local_rank: int, devices_per_node: int, port: int, run_id: str
) -> dict[str, str]:
    """Environment of one worker as torchrun would set it: ``TORCHELASTIC_RUN_ID`` turns on Lightning's
    detection, ``GLOO_SOCKET_IFNAME`` makes gloo bind the node's veth."""
    rank, world = node.index * devices_per_node + local_rank, len(cluster.nodes) * devices_per_node
    values = dict(
        MASTER_ADDR=cluster.nodes[0].ip, MASTER_PORT=port, GLOO_SOCKET_IFNAME=node.ifname,
        RANK=rank, ROLE_RANK=rank, LOCAL_RANK=local_rank, GROUP_RANK=node.index, NODE_RANK=node.index,
        WORLD_SIZE=world, ROLE_WORLD_SIZE=world, LOCAL_WORLD_SIZE=devices_per_node,
        GROUP_WORLD_SIZE=len(cluster.nodes), TORCHELASTIC_RUN_ID=run_id,
        TORCHELASTIC_RESTART_COUNT=0, TORCHELASTIC_MAX_RESTARTS=0,
    )  # fmt: skip
    return worker_env(**{key: str(value) for key, value in values.items()})


def launch(
    cluster: EmulatedCluster, argv: list[str], workdir: Path, devices_per_node: int, port: int, run_id: str
) -> list[subprocess.Popen[bytes]]:
    """Start ``devices_per_node`` workers in every node's namespace, ranks in node order; each logs to
    ``workdir/rank<r>.log``."""
    procs = []
    for node in cluster.nodes:
        for local_rank in range(devices_per_node):
            rank = node.index * devices_per_node + local_rank
            env = rank_env(cluster, node, local_rank, devices_per_node, port, run_id)
            with open(workdir / f"rank{rank}.log", "wb") as log:  # the child holds its own descriptor
                procs.append(
                    cluster.popen(node, argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
                )
    return procs


def watch(
    procs: list[subprocess.Popen[bytes]],
    timeout_s: float,
    poll_s: float,
    on_tick: Callable[[], None] = lambda: None,
    started: float | None = None,
) -> None:
    """Until every worker has exited 0: call ``on_tick`` every ``poll_s``; raise when one fails or the
    run takes longer than ``timeout_s`` (counted from ``started``, default now)."""
    deadline = (time.monotonic() if started is None else started) + timeout_s
    while True:
        on_tick()
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes):
            raise RuntimeError(f"worker failed, exit codes {codes}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"strategy run exceeded {timeout_s} s")
        time.sleep(poll_s)


@dataclass
class StrategyRun:
    """One strategy's run of workers: rank 0's JSON (``worker``), or why it failed (``error``)."""

    strategy: str
    ok: bool = True
    error: str = ""
    worker: dict[str, Any] = field(default_factory=dict)

    @property
    def step_s(self) -> float:
        """Mean step time of the measured window (rank 0, start to start)."""
        return float(self.worker["mean_step_s"])


def run_workers(
    cluster: EmulatedCluster,
    argv: list[str],
    name: str,
    ranks_per_node: int,
    port: int,
    args: Any,
    at_phase: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run ``argv --out DIR/rank0.json --job-dir DIR`` on ``ranks_per_node`` ranks a node (``DIR``: a temp dir
    ``<name>-*``) within ``args.timeout``; returns rank 0's JSON, or raises with the end of the workers' logs.
    ``at_phase(phase)`` runs while rank 0 waits at "start" and "end" (``harness.worker.MarkedWindow``)."""
    with job_dir(f"{name}-", args.keep_logs, stop=cluster.kill_processes) as workdir:
        print(f"[{name}] running {len(cluster.nodes) * ranks_per_node} workers (logs: {workdir})", flush=True)
        try:
            argv = [*argv, *flags(out=workdir / "rank0.json", job_dir=workdir)]
            procs = launch(cluster, argv, workdir, ranks_per_node, port, f"{name}-{os.getpid()}")
            if at_phase is None:
                watch(procs, args.timeout, 0.05)
            else:
                markers = Markers(workdir, ("start", "end"))
                watch(procs, args.timeout, 0.002, lambda: markers.answer(at_phase))
                if markers.missing:
                    raise RuntimeError(f"workers finished without signalling phases {markers.missing}")
            return json.loads((workdir / "rank0.json").read_text())
        except Exception as exc:
            logs = (f"--- {log.name} ---\n{tail(log, 25)}" for log in sorted(workdir.glob("rank*.log")))
            raise RuntimeError("\n".join([str(exc), *logs])) from exc


# ---------------------------------------------------------------------- self-test
_SINK = """
import socket
conn, total = socket.create_server(("", 5201)).accept()[0], 0
while chunk := conn.recv(1 << 20):
    total += len(chunk)
print(total)
"""
_SOURCE = """
import socket, sys, time
for _ in range(100):
    try:
        s = socket.create_connection((sys.argv[1], 5201))
        break
    except OSError:
        time.sleep(0.05)
t0 = time.perf_counter()
for _ in range(int(sys.argv[2])):
    s.sendall(b"x" * (1 << 20))
s.shutdown(socket.SHUT_WR)
s.recv(1)
print(time.perf_counter() - t0)
"""


def self_test(rate_mbit: float = 200, megabytes: int = 50) -> None:
    """Send ``megabytes`` MiB from node 1 to node 0 over TCP and print the achieved rate."""
    with emulated_cluster(num_nodes=2, rate_mbit=rate_mbit) as cluster:
        src, dst = cluster.nodes[1], cluster.nodes[0]
        sink = cluster.popen(dst, [sys.executable, "-c", _SINK], stdout=subprocess.PIPE)
        tx0 = cluster.tx_bytes(src)
        seconds = float(cluster.run(src, [sys.executable, "-c", _SOURCE, dst.ip, str(megabytes)]))
        tx = cluster.tx_bytes(src) - tx0
        received = int(sink.communicate(timeout=30)[0])
        print(f"nodes: {[(n.netns, n.ip, n.ifname) for n in cluster.nodes]}")
        print(f"tbf: rate {rate_mbit} mbit, burst {cluster.burst_bytes} B, latency {cluster.latency_ms} ms")
        print(f"payload {received / 1e6:.1f} MB in {seconds:.2f} s = {received * 8e-6 / seconds:.1f} Mbit/s")
        print(f"tx_bytes delta {tx / 1e6:.1f} MB (= payload x {tx / received:.3f})")
    print(f"leftovers after cleanup (netns, links): {list_stale()}")
