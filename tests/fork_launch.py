"""Run a test script on N local processes as torchrun does, with torch and Lightning imported only once.

``python tests/fork_launch.py --nproc N [--grace S] SCRIPT [ARGS...]``

torchrun starts every worker as a new interpreter, and each one imports torch, Lightning and
lightning_hier again. On a 2-core CPU that costs about 7 s of CPU per worker, and four workers share
two cores. This launcher imports those modules once and forks the workers from that state.

Each worker gets torchrun's environment: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, and ``TORCHELASTIC_RUN_ID``, so Lightning sees a torchelastic launch. Rank 0 hosts the
rendezvous store, as under ``init_process_group("env://")``. The worker then runs the script as
``__main__``.

If a worker fails, the others get ``--grace`` seconds to end on their own (torchrun's
``--monitor-interval``) and are then killed. The launcher exits with the first failing worker's code.
Nothing here spawns a thread before the fork.
"""

from __future__ import annotations

import argparse
import atexit
import os
import random
import runpy
import signal
import sys
import threading
import time
import traceback
import uuid

PRELOADED = ("torch", "torch.distributed", "lightning.pytorch", "lightning_hier")


def _worker(rank: int, world: int, port: int, run_id: str, script: str, args: list[str]) -> int:
    """Runs in the forked child: the script as ``__main__`` with torchrun's variables; its exit code."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default",
        WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), ROLE_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID=run_id,
        TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
    )  # fmt: skip
    import torch

    # a new interpreter's random state: Python's from the OS, torch's default seed
    random.seed()
    torch.manual_seed(torch.initial_seed())
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as exited:
        if exited.code is None or isinstance(exited.code, int):
            return exited.code or 0
        print(exited.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - reported as a fresh interpreter would report it
        sys.stderr.write(f"[rank{rank}]: " + traceback.format_exc().replace("\n", f"\n[rank{rank}]: ") + "\n")
        return 1


def _end_worker(code: int) -> None:
    """End a forked worker as an interpreter ends: its threads joined, its atexit handlers run (process
    groups destroyed, shared memory unlinked), its streams flushed. ``os._exit`` then skips whatever the
    launcher itself would still do after the fork, wherever the launcher runs."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what a normal interpreter exit does first
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(workers: dict[int, int], grace: float) -> int:
    """Wait for every worker; after the first failure the rest get ``grace`` seconds, then are killed."""
    first_failure, deadline, killed = 0, None, False
    while workers:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if deadline is not None and time.monotonic() > deadline and not killed:
                for alive in workers:
                    os.kill(alive, signal.SIGKILL)
                killed = True
            time.sleep(0.02)
            continue
        rank = workers.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and first_failure == 0:
            first_failure = code if code > 0 else 128 - code
            deadline = time.monotonic() + grace
            print(f"fork_launch: rank {rank} exited with {code}", file=sys.stderr)
    return first_failure


def launch(nproc: int, grace: float, script: str, args: list[str]) -> int:
    """Fork ``nproc`` workers running ``script``; the first failing worker's exit code, or 0."""
    for name in PRELOADED:
        __import__(name)
    from helpers import free_port  # beside this file (tests/), imports torch: after the preload

    port, run_id = free_port(), uuid.uuid4().hex
    workers: dict[int, int] = {}
    for rank in range(nproc):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _end_worker(_worker(rank, nproc, port, run_id, script, args))
        workers[pid] = rank
    return _wait(workers, grace)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--grace", type=float, default=5.0)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args()
    return launch(options.nproc, options.grace, options.script, options.args)


if __name__ == "__main__":
    sys.exit(main())
