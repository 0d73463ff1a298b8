"""Destroy the default process group, and with it the package's groups, before the interpreter shuts down.

Gloo's worker threads can still hold asynchronous work (and the tensors of point-to-point sends
or of a communication thread's collectives) when Python finalizes; destroying that state during
finalization aborts the process ("terminate called without an active exception", SIGABRT) even
though training finished. Lightning leaves the group alive after ``fit`` (a Trainer may be used
again), so the strategies register this once per process at setup, and a ``HybridEmbedding`` where it
meets process groups under another strategy (never at import). Destroying the default group destroys
every other group too; the package's registry of groups (:mod:`lightning_hier.topology`, where each is
built once per process) is emptied with it.
"""

from __future__ import annotations

import atexit
import time

import torch.distributed as dist

from lightning_hier.topology import forget_groups

_registered = False


# A gloo worker thread destroys each finished Work *after* waking the caller; destroying it drops
# the Python objects of its tensors, which needs the GIL. When the main thread returns from the
# last collective and the interpreter finalizes within that window, the worker cannot take the GIL
# during finalization and the process aborts ("terminate called without an active exception",
# seen about once in ten runs that end with a collective). A short grace period lets the workers
# finish before Python starts tearing down (a barrier here could wait for a peer that crashed).
_GRACE_SECONDS = 0.2


def _destroy_process_group_at_exit() -> None:
    if dist.is_available() and dist.is_initialized():
        time.sleep(_GRACE_SECONDS)
        dist.destroy_process_group()  # every group, the package's included
    forget_groups()


def destroy_process_group_at_exit() -> None:
    """Register (once) an exit handler that destroys the default group if it still exists."""
    global _registered
    if not _registered:
        atexit.register(_destroy_process_group_at_exit)
        _registered = True
