"""Lightning strategies: thin adapters over the plain-torch engines."""

from lightning_hier.strategies.hier_sliced import HierSlicedStrategy

__all__ = ["HierSlicedStrategy"]
