"""Lightning strategies: thin adapters over the plain-torch engines."""

# first: it checks the installed Lightning against the tested range before anything uses Lightning's internals
from lightning_hier.strategies import lightning_patches  # noqa: F401  # isort: skip

from lightning_hier.strategies.hier_pipeline import HierPipelineStrategy
from lightning_hier.strategies.hier_sliced import HierSlicedStrategy

__all__ = ["HierPipelineStrategy", "HierSlicedStrategy"]
