"""Before a pipeline's first exchange, every stage has joined the device communicator of its group.

Under NCCL a group's communicator is made at its first device operation (unless the process group was
initialised with a ``device_id``), and torch requires every rank of the group to take part when that
first operation is a ``batch_isend_irecv``. A schedule's first exchange involves two stages only, so the
pipeline opens the communicator at setup with a collective of every stage. Proved on 3 CPU processes, the
groups built as on CUDA, every operation recorded: on every rank the first device operation on the
group that carries the activations is a collective of all its ranks, issued before any send or receive.

On the CPU the host and the device are one, so the device operations are told apart by what they carry:
the model computes in float32, so the pipeline's device messages (activations, gradients, the loss) are
float32 here, while its host messages are int64 (activation headers, flags, seeds), float64 (the stages'
batch fingerprints) or pickled objects.
"""

from __future__ import annotations

from pathlib import Path

from helpers import run_torchrun

from lightning_hier.audit import analyze
from lightning_hier.audit.emulation import EMULATED_NCCL
from lightning_hier.audit.recorder import COLLECTIVES
from lightning_hier.topology import DEVICE_BACKEND_ENV

STAGES = 3
DEVICE_DTYPE = "float32"  # SkewedNet's


def _carries_device_data(record: dict) -> bool:
    return any(dtype == DEVICE_DTYPE for _, dtype, _ in record["tensors"])


def test_every_stage_joins_the_device_communicator_before_the_first_exchange(tmp_path: Path) -> None:
    audit_dir = tmp_path / "audit"
    env = {DEVICE_BACKEND_ENV: EMULATED_NCCL, "LIGHTNING_HIER_AUDIT_DIR": str(audit_dir)}
    run_torchrun("pipeline_first_exchange.py", STAGES, str(tmp_path), env=env, timeout=300)
    report = analyze(audit_dir)
    report.raise_if_problems()  # the same collectives in the same order on every member, among others
    assert sorted(report.records) == list(range(STAGES))
    groups = {r["group"] for records in report.records.values() for r in records if r["batch"] is not None}
    assert len(groups) == 1, groups  # the group the activations and gradients travel on
    (group,) = groups
    for rank, records in report.records.items():
        on_group = [r for r in records if r["group"] == group]
        first_device = next(r for r in on_group if _carries_device_data(r))
        assert first_device["op"] in COLLECTIVES, (rank, first_device)
        assert sorted(first_device["group_ranks"]) == list(range(STAGES)), (rank, first_device)
        first_message = next(r for r in on_group if r["peer"] is not None or r["batch"] is not None)
        assert first_device["index"] < first_message["index"], (rank, first_device, first_message)
