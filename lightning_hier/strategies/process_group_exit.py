"""Destroy the default process group before the interpreter shuts down.

Gloo's worker threads can still hold asynchronous work (and the tensors of point-to-point sends
or of a communication thread's collectives) when Python finalizes; destroying that state during
finalization aborts the process ("terminate called without an active exception", SIGABRT) even
though training finished. Lightning leaves the group alive after ``fit`` (a Trainer may be used
again), so the strategies register this once per process.
"""

from __future__ import annotations

import atexit

import torch.distributed as dist

_registered = False


def _destroy_process_group_at_exit() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def destroy_process_group_at_exit() -> None:
    """Register (once) an exit handler that destroys the default group if it still exists."""
    global _registered
    if not _registered:
        atexit.register(_destroy_process_group_at_exit)
        _registered = True
