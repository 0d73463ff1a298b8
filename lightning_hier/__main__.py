"""``python -m lightning_hier fit --config x.yaml``: LightningCLI with the strategies registered.

Any LightningModule / LightningDataModule can be named by ``class_path`` in the config, and
``trainer.strategy`` may be ``hier_sliced`` or a ``class_path: lightning_hier.HierSlicedStrategy``
block with ``init_args``.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

import lightning_hier  # noqa: F401  (registers the strategy names)


def main() -> None:
    LightningCLI(subclass_mode_model=True, subclass_mode_data=True, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
