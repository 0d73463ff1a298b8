"""One process per strategy (``torchrun --nproc_per_node 1``): what Lightning's own tests patch still
reaches the strategy. Writes, per strategy and for Lightning's default strategy as the reference, how
often a ``Strategy.backward`` patched on the base class was called and how often ``time.perf_counter``
(patched as ThroughputMonitor's tests do) was called during fit. ``... OUT_JSON``."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from unittest import mock

import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import Strategy

from lightning_hier import HierBSPStrategy, HierSlicedStrategy

STRATEGIES = {
    "reference": lambda: "auto",
    "hier_sliced": HierSlicedStrategy,
    "hier_bsp": lambda: HierBSPStrategy(superstep=1, max_staleness=0),
}


def counts(make_strategy) -> dict[str, int]:  # noqa: ANN001
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=make_strategy(),
        max_steps=6,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = BoringModel()
    with (
        mock.patch.object(Strategy, "backward", autospec=True, side_effect=Strategy.backward) as backward,
        mock.patch("time.perf_counter", wraps=time.perf_counter) as clock,
    ):
        trainer.fit(model)
    return {"backward": backward.call_count, "perf_counter": clock.call_count}


def main() -> None:
    out = Path(sys.argv[1])
    out.write_text(json.dumps({name: counts(make) for name, make in STRATEGIES.items()}))


if __name__ == "__main__":
    main()
