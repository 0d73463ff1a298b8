"""``python -m lightning_hier fit --config x.yaml``: LightningCLI with the strategies registered;
``python -m lightning_hier plan ...``: the communication cost model (:mod:`lightning_hier.plan`).

Any LightningModule / LightningDataModule can be named by ``class_path`` in the config, and
``trainer.strategy`` may be ``hier_sliced`` or a ``class_path: lightning_hier.HierSlicedStrategy``
block with ``init_args``.
"""

from __future__ import annotations

import sys

from lightning.pytorch.cli import LightningCLI

import lightning_hier  # noqa: F401  (registers the strategy names)


def main() -> None:
    if sys.argv[1:2] == ["plan"]:
        from lightning_hier.plan.cli import main as plan_main

        sys.exit(plan_main(sys.argv[2:]))
    LightningCLI(subclass_mode_model=True, subclass_mode_data=True, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
