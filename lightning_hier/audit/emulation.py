"""An NCCL stand-in for CPU runs: gloo underneath, registered for the ``cuda`` device type only.

torch routes each collective to the backend registered for its tensors' device type. A group
created as ``"cuda:emulated_nccl,cpu:gloo"`` therefore behaves on CPU as ``"cuda:nccl,cpu:gloo"``
does on a GPU: CPU tensors go to gloo. A group created as ``"cuda:emulated_nccl"`` alone has no
backend for CPU tensors and refuses them (``No backend type associated with device type cpu``),
which is what NCCL does with a CPU tensor. Setting ``LIGHTNING_HIER_DEVICE_BACKEND=emulated_nccl``
makes :func:`lightning_hier.topology.resolve_backend` build every group this way on CPU.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from lightning_hier.topology import DEVICE_BACKEND_ENV

EMULATED_NCCL = "emulated_nccl"


def _create_backend(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    from torch.distributed import ProcessGroupGloo

    return ProcessGroupGloo(store, rank, size, timeout)


def register_emulated_nccl() -> None:
    """Register the stand-in once per process (a strategy's setup does it when the environment names it)."""
    if EMULATED_NCCL not in dist.Backend.backend_list:
        dist.Backend.register_backend(EMULATED_NCCL, _create_backend, devices=["cuda"])


def emulate_nccl_in_this_run() -> None:
    """Build this process's groups (and its children's: the variable is inherited) as on CUDA."""
    os.environ[DEVICE_BACKEND_ENV] = EMULATED_NCCL
    register_emulated_nccl()
