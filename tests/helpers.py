"""Launch helpers for tests that need several processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SCRIPTS = Path(__file__).parent / "scripts"

# Lightning's DDPStrategy plumbing, which the package's strategies pass through unchanged
DDP_PLUMBING = {
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
    "process_group_backend",
    "timeout",
    "start_method",
}


# imported once in multiprocessing's forkserver; every test process is forked from it. lightning_hier is left
# out: importing it takes a third of a second, and each process then starts from the package's code as it is
PRELOADED = ["torch", "torch.distributed", "lightning.pytorch"]


def _forkserver() -> Any:
    """The multiprocessing context whose server has torch and Lightning imported (started on first use)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOADED)
    # OpenMP reads its thread count when torch is loaded, in the server: one thread per process, as
    # the tests' processes share two cores
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    return ctx


def _launch_workers(nproc: int, grace: float, script: str, args: list[str], env: dict, log: str) -> None:
    """In a process forked from the server: a session of its own (so a timeout kills every worker), the
    run's environment, output to ``log``, then ``fork_launch.launch``'s workers."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    if env.get("PYTHONWARNINGS") == "ignore":  # read at interpreter start, which the server's was not
        warnings.simplefilter("ignore")
    from fork_launch import launch

    sys.exit(launch(nproc, grace, script, args))


def run_torchrun(
    script: str,
    nproc: int,
    *args: str,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    launcher_args: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """Run ``tests/scripts/<script>`` on ``nproc`` local processes; raise with the log on failure.

    The processes get torchrun's environment (``tests/fork_launch.py``) but are forked from a server that
    imported torch and Lightning once for the whole session: a new interpreter per process costs about
    7 s of CPU for those imports alone. ``env`` adds environment variables for the processes.
    ``launcher_args`` are torchrun's: ``--monitor-interval=S`` (how long the others may go on after one
    fails) is honoured; any other sends the run through torchrun itself."""
    grace = [float(a.split("=", 1)[1]) for a in launcher_args if a.startswith("--monitor-interval=")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    if len(grace) != len(launcher_args):
        return _run_under_torchrun(script, nproc, args, timeout, env, launcher_args)
    handle, log = tempfile.mkstemp(prefix=f"{Path(script).stem}-", suffix=".log")
    os.close(handle)
    path = str(SCRIPTS / script)
    launcher = _forkserver().Process(
        target=_launch_workers, args=(nproc, grace[-1] if grace else 5.0, path, list(args), env, log)
    )
    try:
        launcher.start()
        launcher.join(timeout)
        timed_out = launcher.is_alive()
        if timed_out:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.join()
        output = Path(log).read_text(errors="replace")
    finally:
        os.unlink(log)
    if timed_out:
        raise AssertionError(f"{script} did not finish in {timeout} s:\n{output[-12000:]}")
    if launcher.exitcode != 0:
        raise AssertionError(f"{script} failed ({launcher.exitcode}):\n{output[-12000:]}")
    return subprocess.CompletedProcess([path, *args], 0, output, "")


def _run_under_torchrun(
    script: str, nproc: int, args: tuple[str, ...], timeout: float, env: dict, launcher_args: tuple[str, ...]
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        *launcher_args, str(SCRIPTS / script), *args,
    ]  # fmt: skip
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

    The processes are forked from a server that imported torch and Lightning once for the whole session
    (multiprocessing's forkserver, :data:`PRELOADED`), not started as new interpreters that each import them
    again."""
    ctx = _forkserver()
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
