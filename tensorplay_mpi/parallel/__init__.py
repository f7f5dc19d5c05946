"""Data parallelism: gradient averaging in buckets as a Joinable."""

from .buckets import GradientViews
from .data_parallel import DataParallel

__all__ = ["DataParallel", "GradientViews"]
