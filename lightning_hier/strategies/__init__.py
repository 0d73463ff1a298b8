"""Lightning strategies: thin adapters over the plain-torch engines."""

from lightning_hier.strategies.hier_pipeline import HierPipelineStrategy
from lightning_hier.strategies.hier_sliced import HierSlicedStrategy

__all__ = ["HierPipelineStrategy", "HierSlicedStrategy"]
