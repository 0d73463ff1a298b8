"""1F1B and GPipe on 2 and 4 gloo stages: the math of one process, and the NCCL issuing rules.

The schedules pair each forward send with the matching backward receive (and each backward send
with the next forward receive) in one ``batch_isend_irecv``. Recorded with ``CollectiveAudit``,
every rank's operations must admit one global order (no two stages each waiting on a send queued
behind its own receive), every send must meet a receive of its shape, and no send buffer may be
held past the step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_torchrun

from lightning_hier.audit import analyze
from lightning_hier.audit.emulation import EMULATED_NCCL
from lightning_hier.topology import DEVICE_BACKEND_ENV


@pytest.mark.parametrize("stages", [2, 4])
def test_paired_schedules_match_one_process_and_admit_one_issuing_order(stages: int, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    run_torchrun(
        "schedule_pairing.py", stages, str(out), env={DEVICE_BACKEND_ENV: EMULATED_NCCL}, timeout=300
    )
    per_stage = json.loads(out.read_text())
    for rank_results in per_stage:
        for case, result in rank_results.items():
            assert result["max_diff"] < 1e-6, (case, result)
            assert result["held_sends_after_step"] == 0, case
    report = analyze(tmp_path / "audit")
    report.raise_if_problems()
    records = report.records
    # the steady state really pairs: some batch holds a send and a receive (middle and end stages)
    paired = {
        rank
        for rank, items in records.items()
        for batch in {r["batch"] for r in items if r["batch"] is not None}
        if {r["op"] for r in items if r["batch"] == batch} == {"isend", "irecv"}
    }
    assert paired == set(range(stages)), paired
