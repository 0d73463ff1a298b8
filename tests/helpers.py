"""Launch helpers for tests that need several processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

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

    ``env`` adds environment variables for the processes; ``launcher_args`` go to torchrun itself."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        *launcher_args, str(SCRIPTS / script), *args,
    ]  # fmt: skip
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
