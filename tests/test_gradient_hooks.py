"""Lightning's gradient hooks under hier_sliced see DDP's averaged gradients when asked to, and by default
where the module or a callback overrides them."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import run_torchrun


def test_full_gradients_in_hooks_equal_ddps_by_default_where_a_hook_reads_them(tmp_path: Path) -> None:
    run_torchrun("gradient_hooks.py", 4, str(tmp_path / "out.json"))
    per_rank = json.loads((tmp_path / "out.json").read_text())
    for results in per_rank:
        for hook in ("on_after_backward", "on_before_optimizer_step"):
            for run in ("full", "auto"):  # auto: the snapshot callback overrides the hooks
                assert results[f"{run}/{hook}"] < 1e-5, results  # param.grad and grad_norm as under ddp
                assert results[f"{run}/{hook}/norm"] < 1e-5, results
            assert results[f"local/{hook}"] > 1e-3, results  # each rank's own batch: a real control


def test_auto_turns_full_gradients_on_only_where_a_hook_is_overridden() -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    from lightning_hier import CommProfiler
    from lightning_hier.strategies.gradient_readers import hooks_read_gradients

    class Plain(pl.LightningModule):
        pass

    class LogsNorms(pl.LightningModule):
        def on_before_optimizer_step(self, optimizer) -> None:  # noqa: ANN001
            pass

    class Reads(pl.Callback):
        def on_after_backward(self, trainer, pl_module) -> None:  # noqa: ANN001
            pass

    lightnings_own = [ModelCheckpoint(), LearningRateMonitor()]
    assert not hooks_read_gradients(Plain(), lightnings_own)
    assert hooks_read_gradients(LogsNorms(), lightnings_own)
    assert hooks_read_gradients(Plain(), [*lightnings_own, Reads()])
    assert not hooks_read_gradients(Plain(), [*lightnings_own, CommProfiler()])  # says it reads none
