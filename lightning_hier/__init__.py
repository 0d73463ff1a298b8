"""lightning_hier: hierarchical distributed-training strategies for PyTorch Lightning.

Importing the package registers its strategy names with Lightning, so
``Trainer(strategy="hier_sliced")`` works after ``import lightning_hier``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_hier.callbacks import GradientTimingProfiler
from lightning_hier.comm.buckets import BucketPlan
from lightning_hier.comm.slicing import SlicePlan
from lightning_hier.engine import HierSlicedEngine
from lightning_hier.sharded_checkpoint import consolidate_sharded_checkpoint
from lightning_hier.sparse import HybridEmbedding
from lightning_hier.strategies.hier_sliced import HierSlicedStrategy
from lightning_hier.topology import Topology

__version__ = "0.1.0"

if HierSlicedStrategy.strategy_name not in StrategyRegistry:
    HierSlicedStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "BucketPlan",
    "GradientTimingProfiler",
    "HierSlicedEngine",
    "HierSlicedStrategy",
    "HybridEmbedding",
    "SlicePlan",
    "Topology",
    "consolidate_sharded_checkpoint",
]
