"""Lightning's gradient hooks under hier_sliced see DDP's averaged gradients when asked to."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import run_torchrun


def test_full_gradients_in_hooks_equal_ddps_and_the_default_is_local(tmp_path: Path) -> None:
    run_torchrun("gradient_hooks.py", 4, str(tmp_path / "out.json"))
    per_rank = json.loads((tmp_path / "out.json").read_text())
    for results in per_rank:
        for hook in ("on_after_backward", "on_before_optimizer_step"):
            assert results[f"full/{hook}"] < 1e-5, results  # param.grad and grad_norm as under ddp
            assert results[f"full/{hook}/norm"] < 1e-5, results
            assert results[f"local/{hook}"] > 1e-3, results  # each rank's own batch: a real control
