"""Data parallelism: gradient averaging in buckets as a Joinable."""

from ..gradient_link import GradientViews
from .data_parallel import DataParallel

__all__ = ["DataParallel", "GradientViews"]
