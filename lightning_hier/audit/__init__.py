"""Proof on CPU that every collective would be legal and deadlock-free under NCCL.

Entry point: :class:`CollectiveAudit` (or the environment variables below, for whole runs).

- :mod:`~lightning_hier.audit.emulation`: a CPU run builds its process groups exactly as a CUDA run
  would, with an emulated NCCL registered for the ``cuda`` device type (gloo underneath). A group
  made NCCL-only then refuses CPU tensors with torch's own error, as NCCL does on a GPU, and the
  package takes its CUDA code paths (collectives issued from the training thread, in one order).
- :mod:`~lightning_hier.audit.recorder`: records every ``torch.distributed`` collective and
  point-to-point operation of a process (group, tensors' devices, thread, caller) and flags a
  tensor whose device type the group has no backend for.
- :mod:`~lightning_hier.audit.analysis`: reads every rank's record and checks what no single rank
  can: each group's members issue the same collectives in the same order, every send meets a
  matching receive, and one global issuing order exists across all groups (no cycle of waits).

``LIGHTNING_HIER_AUDIT_DIR=DIR`` records a whole run (every process writes ``DIR/rank<N>.json`` at
exit); add ``LIGHTNING_HIER_DEVICE_BACKEND=emulated_nccl`` to build the groups as on CUDA::

    LIGHTNING_HIER_DEVICE_BACKEND=emulated_nccl LIGHTNING_HIER_AUDIT_DIR=/tmp/audit \\
        python -m lightning_hier fit --config examples/configs/hier_sliced.yaml
    python -m lightning_hier.audit /tmp/audit

Both variables are read by :func:`start_from_env`, which the strategies call at the start of their
``setup_distributed`` (importing the package reads neither); a script that builds its process groups
itself calls it before ``init_process_group``.
"""

from lightning_hier.audit.analysis import AuditReport, analyze
from lightning_hier.audit.emulation import EMULATED_NCCL, register_emulated_nccl
from lightning_hier.audit.recorder import AUDIT_DIR_ENV, CollectiveAudit, CollectiveRecord, install_from_env
from lightning_hier.topology import emulating_cuda

__all__ = [
    "AUDIT_DIR_ENV",
    "EMULATED_NCCL",
    "AuditReport",
    "CollectiveAudit",
    "CollectiveRecord",
    "analyze",
    "install_from_env",
    "register_emulated_nccl",
    "start_from_env",
]


def start_from_env() -> CollectiveAudit | None:
    """Start what the environment asks of this process, once: the emulated NCCL backend
    (``LIGHTNING_HIER_DEVICE_BACKEND``) and the recording of every collective (``LIGHTNING_HIER_AUDIT_DIR``,
    written at exit). Returns the process's audit, or ``None`` when none was asked for.

    Call it before the process group exists: a group naming the emulated backend needs it registered,
    and the record then holds every operation of the run.
    """
    if emulating_cuda():
        register_emulated_nccl()
    return install_from_env()
