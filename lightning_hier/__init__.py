"""lightning_hier: hierarchical distributed-training strategies for PyTorch Lightning.

Importing the package registers its strategy names with Lightning, so
``Trainer(strategy="hier_sliced")``, ``"hier_pipeline"`` and ``"hier_bsp"`` work after
``import lightning_hier``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_hier.audit import install_from_env, register_emulated_nccl
from lightning_hier.bucketing.size_plan import BucketPlan
from lightning_hier.callbacks import CommProfiler, GradientTimingProfiler, StageRebalancer
from lightning_hier.sliced.engine import HierSlicedEngine
from lightning_hier.sliced.sharded_checkpoint import consolidate_sharded_checkpoint
from lightning_hier.sliced.slicing import SlicePlan
from lightning_hier.sparse import HybridEmbedding
from lightning_hier.strategies.hier_bsp import HierBSPStrategy
from lightning_hier.strategies.hier_pipeline import HierPipelineStrategy
from lightning_hier.strategies.hier_sliced import HierSlicedStrategy
from lightning_hier.strategies.process_group_exit import destroy_process_group_at_exit
from lightning_hier.topology import Topology, emulating_cuda

__version__ = "0.1.0"

if emulating_cuda():  # LIGHTNING_HIER_DEVICE_BACKEND: a CPU run whose groups are built as on CUDA
    register_emulated_nccl()
install_from_env()  # LIGHTNING_HIER_AUDIT_DIR: record every collective of this process
# any run that imports the package (ddp with a HybridEmbedding too) ends without gloo's exit race
destroy_process_group_at_exit()

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
    "SlicePlan",
    "StageRebalancer",
    "Topology",
    "consolidate_sharded_checkpoint",
]
