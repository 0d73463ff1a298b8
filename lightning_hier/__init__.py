"""lightning_hier: hierarchical distributed-training strategies for PyTorch Lightning.

Importing the package registers its strategy names with Lightning, so
``Trainer(strategy="hier_sliced")``, ``"hier_pipeline"`` and ``"hier_bsp"`` work after
``import lightning_hier``, and does nothing else: the collective audit, the emulated NCCL backend and
the exit handler start at a strategy's setup (or by :func:`lightning_hier.audit.start_from_env`).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_hier.bucketing.size_plan import BucketPlan
from lightning_hier.bucketing.time_bucketing import TimeBuckets
from lightning_hier.callbacks import CommProfiler, GradientTimingProfiler, StageRebalancer
from lightning_hier.pipeline.settings import Rebalance
from lightning_hier.sliced.engine import HierSlicedEngine
from lightning_hier.sliced.sharded_checkpoint import consolidate_sharded_checkpoint
from lightning_hier.sliced.slicing import SlicePlan
from lightning_hier.sparse import HybridEmbedding
from lightning_hier.strategies.hier_bsp import HierBSPStrategy
from lightning_hier.strategies.hier_pipeline import HierPipelineStrategy
from lightning_hier.strategies.hier_sliced import HierSlicedStrategy
from lightning_hier.topology import Topology

__version__ = "0.1.0"

for _strategy in (HierSlicedStrategy, HierPipelineStrategy, HierBSPStrategy):
    if _strategy.strategy_name not in StrategyRegistry:
        _strategy.register_strategies(StrategyRegistry)

__all__ = [
    "BucketPlan",
    "CommProfiler",
    "GradientTimingProfiler",
    "HierBSPStrategy",
    "HierPipelineStrategy",
    "HierSlicedEngine",
    "HierSlicedStrategy",
    "HybridEmbedding",
    "Rebalance",
    "SlicePlan",
    "StageRebalancer",
    "TimeBuckets",
    "Topology",
    "consolidate_sharded_checkpoint",
]
