"""Lightning callbacks: thin views onto the engines."""

from lightning_hier.callbacks.comm_profiler import CommProfiler
from lightning_hier.callbacks.gradient_timing import GradientTimingProfiler
from lightning_hier.callbacks.stage_rebalancer import StageRebalancer

__all__ = ["CommProfiler", "GradientTimingProfiler", "StageRebalancer"]
