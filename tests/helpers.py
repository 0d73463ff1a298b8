"""Launch helpers for tests that need several processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SCRIPTS = Path(__file__).parent / "scripts"


def run_torchrun(
    script: str,
    nproc: int,
    *args: str,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    launcher_args: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """Run ``tests/scripts/<script>`` on ``nproc`` local processes; raise with the log on failure.

    The processes are forked by ``tests/fork_launch.py`` with torchrun's environment, so torch and Lightning
    are imported once rather than once per process. ``env`` adds environment variables for the processes.
    ``launcher_args`` are torchrun's: ``--monitor-interval=S`` (how long the others may go on after one
    fails) is honoured by the fork launcher; any other sends the run through torchrun itself."""
    grace = [a.split("=", 1)[1] for a in launcher_args if a.startswith("--monitor-interval=")]
    if len(grace) == len(launcher_args):
        launcher = [
            str(Path(__file__).parent / "fork_launch.py"),
            f"--nproc={nproc}",
            *(f"--grace={g}" for g in grace),
        ]
    else:
        launcher = [
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            *launcher_args,
        ]
    cmd = [sys.executable, *launcher, str(SCRIPTS / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    # a session of its own, so a hang kills the workers too (torchrun alone would leave them behind)
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    ) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as timed_out:
            os.killpg(popen.pid, signal.SIGKILL)
            stdout, stderr = popen.communicate()
            raise AssertionError(
                f"{script} did not finish in {timeout} s:\n{stdout[-4000:]}\n{stderr[-8000:]}"
            ) from timed_out
    proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
    if proc.returncode != 0:
        raise AssertionError(
            f"{script} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_gloo(rank: int, world: int, store: str, timeout_s: float = 60) -> None:
    """A gloo default group for a spawned test process (file store, one compute thread)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )


def run_spawned(fn: Callable[..., Any], world: int, tmp_path: Path, *args: Any) -> list:
    """Run ``fn(rank, world, store, *args)`` on ``world`` new processes; return per-rank results
    (what ``fn`` returned, ``{"error", "traceback"}`` if it raised, ``None`` if the process died).

    The processes are forked from a server that imported torch and lightning_hier once for the whole
    session (multiprocessing's forkserver), not started as new interpreters that each import them again."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "lightning_hier"])
    store = str(tmp_path / "store")
    procs = [
        ctx.Process(target=_spawned, args=(fn, r, world, store, str(tmp_path), *args)) for r in range(world)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=180)
    results = []
    for rank in range(world):
        path = tmp_path / f"result{rank}.pt"
        results.append(torch.load(path, weights_only=False) if path.exists() else None)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    return results


def _spawned(fn: Callable[..., Any], rank: int, world: int, store: str, out_dir: str, *args: Any) -> None:
    try:
        result = fn(rank, world, store, *args)
    except BaseException as err:  # reported to the test instead of a bare exit code
        result = {"error": repr(err), "traceback": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"result{rank}.pt"))
