"""One process (``torchrun --nproc_per_node 1``): what a fit leaves replaced on Lightning's and the user's
objects, per strategy and under Lightning's default strategy as the reference. ``... OUT_JSON``.

For the trainer's loops, the precision plugin, the module and the optimizer it records the names of the
instance attributes that shadow a method of their class (a method replaced for the run and not put back)
and the plugin's class name, and whether the fitted Trainer pickles.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_hier import HierBSPStrategy, HierPipelineStrategy, HierSlicedStrategy

STRATEGIES = {
    "reference": lambda: "auto",
    "hier_sliced": HierSlicedStrategy,
    # max_staleness=1: workers off lockstep, where hier_bsp replaces the most of Lightning's loop methods
    "hier_bsp": lambda: HierBSPStrategy(max_staleness=1),
    "hier_pipeline": HierPipelineStrategy,
}


def replaced(owner: Any) -> list[str]:
    """Instance attributes of ``owner`` that shadow a method of its class."""
    cls = type(owner)
    return sorted(name for name in vars(owner) if callable(getattr(cls, name, None)))


def left_behind(make_strategy: Any) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=make_strategy(),
        max_epochs=2,
        limit_train_batches=4,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = BoringModel()
    plugin = trainer.precision_plugin
    plugin_class = type(plugin).__name__
    trainer.fit(model)
    objects = {
        "fit_loop": trainer.fit_loop,
        "epoch_loop": trainer.fit_loop.epoch_loop,
        "validate_loop": trainer.validate_loop,
        "test_loop": trainer.test_loop,
        "predict_loop": trainer.predict_loop,
        "precision_plugin": plugin,
        "module": model,
        "optimizer": trainer.optimizers[0],
    }
    result: dict[str, Any] = {name: replaced(owner) for name, owner in objects.items()}
    result["plugin_class"] = [plugin_class, type(plugin).__name__]
    try:
        pickle.dumps(trainer)
        result["pickles"] = "yes"
    except Exception as error:  # noqa: BLE001 - what failed is the result
        result["pickles"] = f"{type(error).__name__}: {error}"
    return result


def main() -> None:
    out = Path(sys.argv[1])
    out.write_text(json.dumps({name: left_behind(make) for name, make in STRATEGIES.items()}, indent=2))


if __name__ == "__main__":
    main()
