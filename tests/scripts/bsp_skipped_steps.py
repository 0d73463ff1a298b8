"""Run under torchrun (1 process): ``training_step`` returning ``None`` (a skipped step, which Lightning
allows on one process) under plain ``hier_bsp`` against the default single-device strategy.

A skipped micro-step counted toward the superstep's quota while folding nothing would leave the next step
waiting for a model that never comes. ``bsp_skipped_steps.py OUT`` writes the comparison as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
from models import EquivModel, loader  # noqa: E402
from train_equivalence import max_rel_diff  # noqa: E402

from lightning_hier import HierBSPStrategy  # noqa: E402


class SkipsEvenBatches(EquivModel):
    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        if batch_idx % 2 == 0:
            return None
        return super().training_step(batch, batch_idx)


def run(strategy) -> tuple[dict, int]:  # noqa: ANN001
    pl.seed_everything(5, verbose=False)
    model = SkipsEvenBatches(optimizer="adam")
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(model, train_dataloaders=loader(n=128))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, trainer.global_step


def main() -> None:
    reference, reference_steps = run("auto")
    bsp, bsp_steps = run(HierBSPStrategy(superstep=1, max_staleness=0))
    Path(sys.argv[1]).write_text(
        json.dumps({"steps": [reference_steps, bsp_steps], "max_rel_diff": max_rel_diff(reference, bsp)})
    )


if __name__ == "__main__":
    main()
