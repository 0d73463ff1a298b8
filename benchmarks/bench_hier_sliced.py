"""Compare Lightning ``ddp`` with ``hier_sliced`` on an emulated 2-node x 2-device cluster.

Two network namespaces act as nodes, joined by a bridge; each node's egress is
shaped to ``--rate-mbit`` (see ``netns_cluster.py``).  For every strategy four
worker processes (``_hier_sliced_worker.py``) are launched with torchrun-style
environment variables, ranks 0-1 in node 0 and ranks 2-3 in node 1, with
``GLOO_SOCKET_IFNAME`` set to the node's veth so that intra-node traffic takes
the namespace-local path and only inter-node traffic crosses the shaped link.

The workers handshake the start and end of the measured window with this
driver (marker files), which reads both nodes' ``tx_bytes`` at those points.
Reported per strategy: mean step time, ratio to ddp, and bytes each node sent
per step as a multiple of the bandwidth-optimal bound ``2 (N - 1) / N * S``
(N nodes, S gradient bytes).

Needs root and iproute2::

    sudo python benchmarks/bench_hier_sliced.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from netns_cluster import EmulatedCluster, Node, emulated_cluster

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
WORKER = HERE / "_hier_sliced_worker.py"
NUM_NODES = 2
DEVICES_PER_NODE = 2
BASE_PORT = 29540
TARGET_STEP_RATIO = 0.75
TARGET_BYTES_X_BOUND = 1.1
PHASES = ("start", "end")


@dataclass
class RunResult:
    """Outcome of one strategy run."""

    strategy: str
    ok: bool
    error: str = ""
    worker: dict[str, Any] = field(default_factory=dict)
    tx_bytes: dict[str, list[int]] = field(default_factory=dict)

    @property
    def step_s(self) -> float:
        """Mean wall time per measured step (start-to-start)."""
        return float(self.worker["mean_step_s"])

    def bytes_per_step(self) -> list[float]:
        """Bytes each node sent per measured step."""
        start, end = self.tx_bytes["start"], self.tx_bytes["end"]
        return [(e - s) / self.worker["steps"] for s, e in zip(start, end, strict=True)]

    def bound_bytes(self) -> float:
        """Bandwidth-optimal per-node bytes per step, ``2 (N-1)/N * S``."""
        n = self.worker["num_nodes"]
        return 2 * (n - 1) / n * self.worker["grad_bytes"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of the driver."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate-mbit", type=float, default=200, help="egress limit per node (Mbit/s)")
    p.add_argument("--steps", type=int, default=8, help="measured steps")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps before measuring")
    p.add_argument("--hidden", type=int, default=1024, help="MLP width")
    p.add_argument("--layers", type=int, default=6, help="number of Linear(hidden, hidden) layers")
    p.add_argument("--batch-size", type=int, default=8, help="per-process batch size")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="bucket cap for both strategies (MB)")
    p.add_argument("--strategies", default="ddp,hier_sliced", help="comma-separated: ddp, hier_sliced")
    p.add_argument("--json-out", type=Path, default=None, help="write all results as JSON here")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per strategy run")
    p.add_argument("--keep-logs", action="store_true", help="keep the per-run temp dir with worker logs")
    args = p.parse_args(argv)
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = set(args.strategies) - {"ddp", "hier_sliced"}
    if unknown:
        p.error(f"unknown strategies: {sorted(unknown)}")
    return args


def worker_env(
    cluster: EmulatedCluster, node: Node, local_rank: int, port: int, run_id: str
) -> dict[str, str]:
    """Environment of one worker, as torchrun would set it (TORCHELASTIC_RUN_ID enables detection)."""
    world_size = len(cluster.nodes) * DEVICES_PER_NODE
    rank = node.index * DEVICES_PER_NODE + local_rank
    env = dict(os.environ)
    env.update(
        {
            "MASTER_ADDR": cluster.nodes[0].ip,
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world_size),
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(DEVICES_PER_NODE),
            "GROUP_RANK": str(node.index),
            "NODE_RANK": str(node.index),
            "GROUP_WORLD_SIZE": str(len(cluster.nodes)),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world_size),
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "GLOO_SOCKET_IFNAME": node.ifname,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def worker_argv(args: argparse.Namespace, strategy: str, signal_dir: Path, out: Path) -> list[str]:
    """Command line of one worker."""
    return [
        sys.executable,
        str(WORKER),
        "--strategy",
        strategy,
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--batch-size",
        str(args.batch_size),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--bucket-cap-mb",
        str(args.bucket_cap_mb),
        "--signal-dir",
        str(signal_dir),
        "--out",
        str(out),
    ]


def launch_workers(
    cluster: EmulatedCluster, args: argparse.Namespace, strategy: str, port: int, workdir: Path
) -> list[subprocess.Popen[bytes]]:
    """Start ``DEVICES_PER_NODE`` workers in every node's namespace; logs go to ``workdir``."""
    procs = []
    argv = worker_argv(args, strategy, workdir, workdir / "rank0.json")
    run_id = f"lhbench-{strategy}-{os.getpid()}"
    for node in cluster.nodes:
        for local_rank in range(DEVICES_PER_NODE):
            rank = node.index * DEVICES_PER_NODE + local_rank
            log = open(workdir / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed when the run ends
            env = worker_env(cluster, node, local_rank, port, run_id)
            proc = cluster.popen(node, argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
            procs.append(proc)
            log.close()  # the child holds its own descriptor
    return procs


def serve_phases(
    cluster: EmulatedCluster, procs: list[subprocess.Popen[bytes]], workdir: Path, timeout_s: float
) -> dict[str, list[int]]:
    """Until all workers exit: answer phase markers by reading every node's tx_bytes, then acking."""
    readings: dict[str, list[int]] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        for phase in PHASES:
            if phase not in readings and (workdir / f"{phase}.ready").exists():
                readings[phase] = cluster.tx_bytes_all()
                (workdir / f"{phase}.ack").touch()
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes):
            raise RuntimeError(f"worker failed, exit codes {codes}")
        if all(c == 0 for c in codes):
            return readings
        if time.monotonic() > deadline:
            raise TimeoutError(f"strategy run exceeded {timeout_s} s")
        time.sleep(0.002)


def log_tail(workdir: Path, lines: int = 25) -> str:
    """Last lines of every worker log, for error reports."""
    parts = []
    for log in sorted(workdir.glob("rank*.log")):
        text = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log.name} ---\n" + "\n".join(text))
    return "\n".join(parts)


def run_strategy(cluster: EmulatedCluster, args: argparse.Namespace, strategy: str, port: int) -> RunResult:
    """Run one strategy on the cluster and collect timings and byte counts."""
    workdir = Path(tempfile.mkdtemp(prefix=f"lhbench-{strategy}-"))
    print(f"[{strategy}] running 4 workers (logs: {workdir}) ...", flush=True)
    try:
        procs = launch_workers(cluster, args, strategy, port, workdir)
        tx = serve_phases(cluster, procs, workdir, args.timeout)
        missing = [p for p in PHASES if p not in tx]
        if missing:
            raise RuntimeError(f"workers finished without signalling phases {missing}")
        worker = json.loads((workdir / "rank0.json").read_text())
        return RunResult(strategy, ok=True, worker=worker, tx_bytes=tx)
    except Exception as exc:  # report and continue with the next strategy
        return RunResult(strategy, ok=False, error=f"{exc}\n{log_tail(workdir)}")
    finally:
        cluster.kill_processes()
        if not args.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)


def format_table(results: list[RunResult]) -> str:
    """Human-readable comparison table."""
    ddp = next((r for r in results if r.ok and r.strategy == "ddp"), None)
    header = (
        f"{'strategy':<12} {'step [s]':>9} {'vs ddp':>7} {'grad MB':>8} {'bound MB':>9} "
        f"{'node0 MB/step':>14} {'x bound':>8} {'node1 MB/step':>14} {'x bound':>8} {'Mbit/s/node':>12}"
    )
    rows = [header, "-" * len(header)]
    for r in results:
        if not r.ok:
            rows.append(f"{r.strategy:<12} FAILED (see below)")
            continue
        ratio = f"{r.step_s / ddp.step_s:.3f}" if ddp else "n/a"
        bps = r.bytes_per_step()
        bound = r.bound_bytes()
        cells = " ".join(f"{b / 1e6:>14.2f} {b / bound:>8.3f}" for b in bps)
        mbit = max(bps) * 8 / r.step_s / 1e6
        rows.append(
            f"{r.strategy:<12} {r.step_s:>9.3f} {ratio:>7} {r.worker['grad_bytes'] / 1e6:>8.2f} "
            f"{bound / 1e6:>9.2f} {cells} {mbit:>12.1f}"
        )
    return "\n".join(rows)


def format_targets(results: list[RunResult]) -> str:
    """Targets for hier_sliced and whether they are met."""
    ddp = next((r for r in results if r.ok and r.strategy == "ddp"), None)
    hier = next((r for r in results if r.strategy == "hier_sliced"), None)
    lines = [
        f"targets: hier_sliced/ddp step time <= {TARGET_STEP_RATIO}; "
        f"hier_sliced bytes per node per step <= {TARGET_BYTES_X_BOUND} x bound"
    ]
    if hier is None or not hier.ok:
        lines.append("  hier_sliced: not run or failed -> targets not evaluated")
        return "\n".join(lines)
    if ddp is None:
        lines.append("  step-time ratio: ddp not run -> not evaluated")
    else:
        ratio = hier.step_s / ddp.step_s
        lines.append(f"  step-time ratio {ratio:.3f} -> {'MET' if ratio <= TARGET_STEP_RATIO else 'NOT MET'}")
    worst = max(hier.bytes_per_step()) / hier.bound_bytes()
    verdict = "MET" if worst <= TARGET_BYTES_X_BOUND else "NOT MET"
    lines.append(f"  bytes {worst:.3f} x bound (worst node) -> {verdict}")
    return "\n".join(lines)


def report(args: argparse.Namespace, cluster: EmulatedCluster, results: list[RunResult]) -> None:
    """Print the table, targets and errors; optionally write JSON."""
    print()
    print(
        f"emulated cluster: {NUM_NODES} nodes x {DEVICES_PER_NODE} devices, {args.rate_mbit:g} Mbit/s egress "
        f"per node (tbf burst {cluster.burst_bytes} B, latency {cluster.latency_ms} ms)\n"
        f"MLP {args.layers} x Linear({args.hidden}, {args.hidden}), batch {args.batch_size}/process, "
        f"warmup {args.warmup}, measured steps {args.steps}"
    )
    print(format_table(results))
    print()
    print(format_targets(results))
    for r in results:
        if not r.ok:
            print(f"\n[{r.strategy}] FAILED:\n{r.error}")
    if args.json_out:
        payload = {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "results": [asdict(r) for r in results],
        }
        args.json_out.write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {args.json_out}")


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """Turn SIGTERM into SystemExit so that workers and namespaces are cleaned up."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Run all requested strategies on one emulated cluster; return a process exit code."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    results: list[RunResult] = []
    try:
        with emulated_cluster(num_nodes=NUM_NODES, rate_mbit=args.rate_mbit) as cluster:
            for i, strategy in enumerate(args.strategies):
                results.append(run_strategy(cluster, args, strategy, BASE_PORT + i))
            report(args, cluster, results)
    except KeyboardInterrupt:
        print("\ninterrupted; workers stopped and emulated cluster removed", file=sys.stderr)
        return 130
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
