"""``hier_bsp`` with a worker that takes no micro-step in an epoch (every batch it drew was skipped, or it
drew none): its local module still ticks with the others', so their drains at the epoch's end complete and
the fit runs every epoch, where it used to wait on the idle worker's paused module until the timeout."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import run_torchrun


def test_a_worker_without_micro_steps_does_not_stall_the_others(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    run_torchrun("bsp_idle_worker.py", 2, str(out), timeout=240)
    result = json.loads(out.read_text())
    assert result["epochs"] == 3
    assert result["steps"][1] == 0 and result["steps"][0] >= 3  # rank 0 stepped in every epoch, rank 1 never
    assert result["agree"] and result["moved"] > 0  # one model, trained by rank 0's gradients
