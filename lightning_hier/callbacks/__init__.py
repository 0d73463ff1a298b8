"""Lightning callbacks: thin views onto the engines."""

from lightning_hier.callbacks.gradient_timing import GradientTimingProfiler

__all__ = ["GradientTimingProfiler"]
