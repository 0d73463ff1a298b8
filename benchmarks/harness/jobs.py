"""Worker processes on the local machine: launch, handshake, stop, and the checks that the host is quiet.

A benchmark job is one ``torch.distributed.run --standalone`` launch (or one worker per rank in an
emulated cluster, see :mod:`harness.cluster`) with its own temp dir for logs, results and marker
files. Everything a job starts is stopped by process id when it ends, fails or is interrupted.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

BENCH_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
BUSY_HOST_CORES = 0.2  # CPU use of other processes (cores) above which a job counts as disturbed
USER_NICE_SYSTEM = (0, 1, 2)  # fields of the "cpu" line of /proc/stat
WITH_IRQ_AND_STEAL = (0, 1, 2, 5, 6, 7)  # plus irq, softirq, steal (guest time is already in user)


# ---------------------------------------------------------------------- launch
def worker_env(**extra: str) -> dict[str, str]:
    """This process's environment for a worker: one OpenMP thread, the repository on ``PYTHONPATH``
    (so ``lightning_hier`` is imported from it), unbuffered output, plus ``extra``."""
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **extra}


def flags(**values: object) -> list[str]:
    """``--name value`` for every value that is not None (``_`` in a name becomes ``-``)."""
    return [arg for k, v in values.items() if v is not None for arg in (f"--{k.replace('_', '-')}", str(v))]


def pick(namespace: object, *names: str) -> dict[str, Any]:
    """``{name: namespace.name}`` for ``names``, in that order (to pass options on with :func:`flags`)."""
    return {name: getattr(namespace, name) for name in names}


def tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a log ("" when there is none)."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


@contextlib.contextmanager
def job_dir(
    prefix: str, keep: bool, stop: Callable[[], None] = lambda: None, show: bool = False
) -> Iterator[Path]:
    """A temp dir for one job; on exit ``stop`` stops the job, then the dir is removed unless ``keep``
    (``show``: then print where it is)."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield workdir
    finally:
        stop()
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        elif show:
            print(f"    logs: {workdir}", flush=True)


@contextlib.contextmanager
def torchrun(
    nproc: int, script: Path, argv: Sequence[str], workdir: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """``python -m torch.distributed.run --standalone --nproc_per_node NPROC script argv`` in a session of
    its own (output in ``workdir/job.log``), stopped with its workers on exit; the workers write
    ``workdir/pid.<rank>``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    with open(workdir / "job.log", "wb") as log:
        proc = subprocess.Popen(
            [*cmd, str(script), *argv],
            env=env or worker_env(),
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        stop_job(proc, workdir, nproc)


def run_to_result(nproc: int, script: Path, config: dict[str, Any], workdir: Path, timeout: float) -> Any:
    """Run one job of ``nproc`` workers given ``config`` (as JSON) and ``workdir``, and return what its
    workers wrote to ``workdir/result.json``; exit with the log's tail when it fails or times out."""
    with torchrun(nproc, script, [json.dumps(config), str(workdir)], workdir) as proc:
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = -1
    result = workdir / "result.json"
    if code != 0 or not result.exists():
        raise SystemExit(f"job failed (exit {code}):\n{tail(workdir / 'job.log', 60)}")
    return json.loads(result.read_text())


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so that the ``finally`` blocks stop the workers (and namespaces)."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def check_exit(code: int) -> None:
    """Raise when the launcher failed."""
    if code != 0:
        raise RuntimeError(f"torch.distributed.run exited with code {code}")


def live_workers(workdir: Path, nproc: int) -> list[int]:
    """Pids of this job's workers that still run (checked by command line: pids can be reused)."""
    pids = []
    for rank in range(nproc):
        with contextlib.suppress(OSError, ValueError):
            pid = int((workdir / f"pid.{rank}").read_text())
            if str(workdir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
    return pids


def stop_job(proc: subprocess.Popen[bytes], workdir: Path, nproc: int, grace_s: float = 5.0) -> None:
    """Stop what a job started, by id: the launcher's process group and the workers (which
    ``torch.distributed.run`` starts in sessions of their own). SIGTERM first, SIGKILL after ``grace_s``."""

    def signal_workers(sig: int) -> None:
        for pid in live_workers(workdir, nproc):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    if proc.poll() is None:  # not reaped yet, so its process group id is still ours
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        signal_workers(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    signal_workers(signal.SIGKILL)  # normally none left: the launcher stops its workers


class Markers:
    """The driver's side of the handshake with a job's rank 0 (see ``harness.worker.handshake``): rank 0
    writes ``<phase>.ready`` in the job's dir and waits; the driver acts, then writes ``<phase>.ack``."""

    def __init__(self, workdir: Path, phases: Sequence[str]) -> None:
        self.workdir = workdir
        self.phases = phases
        self.acked: list[str] = []

    def answer(self, act: Callable[[str], None]) -> None:
        """``act(phase)``, then acknowledge, for every phase that rank 0 announced since the last call."""
        for phase in self.phases:
            if phase not in self.acked and (self.workdir / f"{phase}.ready").exists():
                act(phase)
                (self.workdir / f"{phase}.ack").touch()
                self.acked.append(phase)

    @property
    def missing(self) -> list[str]:
        """Phases not announced (yet)."""
        return [phase for phase in self.phases if phase not in self.acked]


# ---------------------------------------------------------------------- host load
def host_busy_seconds(fields: Sequence[int] = USER_NICE_SYSTEM) -> float:
    """CPU seconds all cores spent in the given modes of ``/proc/stat`` since boot."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    return sum(values[i] for i in fields) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of ``pids`` (all their threads), from ``/proc/<pid>/stat``."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


Snapshot = tuple[float, float, float]


def cpu_snapshot(pids: Sequence[int] = (), fields: Sequence[int] = USER_NICE_SYSTEM) -> Snapshot:
    """``(wall, host busy CPU seconds, CPU seconds of pids, of this driver and of its reaped children)``.

    The difference of two snapshots minus our own share is CPU that *other* processes used meanwhile:
    on a small host a concurrent job slows compute and skews the comparison.
    """
    ours = process_cpu_seconds(pids)
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        ours += usage.ru_utime + usage.ru_stime
    return time.monotonic(), host_busy_seconds(fields), ours


def other_cores(before: Snapshot, after: Snapshot) -> float:
    """Mean number of cores used by processes other than ours between two snapshots."""
    return max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / max(after[0] - before[0], 1e-9)


def wait_idle(
    timeout_s: float, indent: str = "  ", fields: Sequence[int] = USER_NICE_SYSTEM, sample_s: float = 2.0
) -> float:
    """Wait (up to ``timeout_s``) until other processes use less than ``BUSY_HOST_CORES``; returns
    the last sampled use in cores."""
    deadline = time.monotonic() + timeout_s
    while True:
        before = cpu_snapshot(fields=fields)
        time.sleep(sample_s)
        other = other_cores(before, cpu_snapshot(fields=fields))
        if other <= BUSY_HOST_CORES or time.monotonic() >= deadline:
            return other
        print(f"{indent}host busy ({other:.2f} cores used by other processes), waiting ...", flush=True)


class Measured(Protocol):
    """A job's result as :func:`run_until_quiet` sees it."""

    ok: bool
    other_cores: float


R = TypeVar("R", bound=Measured)


def run_until_quiet(
    run: Callable[[int], R],
    retries: int,
    wait_s: float,
    busy_note: str,
    note_last: bool = False,
    keep_best: bool = True,
    **idle: Any,
) -> R:
    """``run(attempt)`` (from 1) after waiting up to ``wait_s`` for an idle host (:func:`wait_idle` with
    ``idle``); again, up to ``retries`` times, while other processes used more than ``BUSY_HOST_CORES``.

    Returns a failed result at once; else the least disturbed one (``keep_best``) or the last one.
    ``busy_note`` (formatted with the cores others used) is printed about a disturbed result that is
    run again (``note_last``: also about the last one).
    """
    chosen: R | None = None
    for attempt in range(1, retries + 2):
        if wait_s > 0:
            wait_idle(wait_s, **idle)
        result = run(attempt)
        if not result.ok:
            return result
        if chosen is None or not keep_best or result.other_cores < chosen.other_cores:
            chosen = result
        if result.other_cores <= BUSY_HOST_CORES:
            break
        if attempt <= retries or note_last:
            print(busy_note.format(result.other_cores), flush=True)
    assert chosen is not None
    return chosen
