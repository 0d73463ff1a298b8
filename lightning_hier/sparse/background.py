"""One thread per process that runs the tables' gradient exchanges and row updates beside training.

Why a thread of our own: the exchange of a table's per-id gradients and the node leader's row update
need only the embedding gradients, which exist once backward has passed the table. Run on the main
thread, they wait for the slowest peer twice per step (gather, then the node barrier after the
update) while the dense reduction, the dense optimizer step and Lightning's end-of-step work could
have gone on. On this thread they overlap all of that; the main thread waits only where a table is
read next (the next forward, a checkpoint, an export).

The jobs run strictly in submission order, and they issue collectives only on the groups the tables
were given for the exchange (built for this thread alone, so one thread issues on each group in one
order on every rank, the device rule). A job's exception is raised again by :meth:`TableJobs.wait`
in the thread that waits, so a peer lost during an exchange ends training with the collective's error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class TableJobs:
    """A first-in-first-out queue of table jobs run by one thread of its own, with a wait for all of them."""

    def __init__(self, name: str = "lightning_hier-tables") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._outstanding: list[Future] = []
        self._worker: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job`` behind every job submitted before it."""
        self._outstanding.append(self._executor.submit(self._run, job))

    def _run(self, job: Callable[[], None]) -> None:
        self._worker = threading.current_thread()
        with torch.no_grad():  # grad mode is per thread: the jobs write tables and never build graphs
            job()

    @property
    def busy(self) -> bool:
        """Whether some submitted job has not been waited for."""
        return bool(self._outstanding)

    def wait(self) -> None:
        """Block until every submitted job has run; raise the first error one of them raised.

        A no-op on the jobs' own thread (a job that reads a table must not wait for itself)."""
        if threading.current_thread() is self._worker:
            return
        outstanding, self._outstanding = self._outstanding, []
        error: BaseException | None = None
        for future in outstanding:
            exception = future.exception()
            if exception is not None and error is None:
                error = exception
        if error is not None:
            raise error

    def close(self) -> None:
        """Wait for the queued jobs (raising their error), then end the thread."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
