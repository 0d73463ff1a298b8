"""Collectives over groups of one rank: skipped, unless a check asks for every one of them to run.

A group of one rank has nothing to exchange, so the strategies skip its reduce-scatters, all-reduces
and all-gathers (a copy at most). That is right for training, but it leaves a one-GPU run with nothing
on its NCCL communicators: no stream waits, no events, nothing for torch's CUDA stream sanitizer
(``TORCH_CUDA_SANITIZER=1``) to check. Set ``LIGHTNING_HIER_FORCE_COLLECTIVES=1`` and every such
collective is issued as it would be on a larger group (a sum over one rank leaves the values as they
are), so one device exercises the whole multi-rank path. For checks only: it costs time and changes no
result.
"""

from __future__ import annotations

import os

import torch.distributed as dist

FORCE_COLLECTIVES_ENV = "LIGHTNING_HIER_FORCE_COLLECTIVES"


def forcing_collectives() -> bool:
    """Whether collectives over one-rank groups are issued anyway (``LIGHTNING_HIER_FORCE_COLLECTIVES=1``)."""
    return os.environ.get(FORCE_COLLECTIVES_ENV, "0") not in ("", "0", "false", "False")


def alone_in(group: dist.ProcessGroup | None = None) -> bool:
    """True where ``group`` has one rank and its collectives may be skipped (never while forcing them)."""
    return dist.get_world_size(group) == 1 and not forcing_collectives()


def alone(size: int) -> bool:
    """:func:`alone_in` for a group size already known."""
    return size == 1 and not forcing_collectives()
