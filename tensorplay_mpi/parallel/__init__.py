"""Data parallelism: gradient averaging in buckets as a Joinable."""

from .data_parallel import DataParallel
from .gradient_link import GradientViews

__all__ = ["DataParallel", "GradientViews"]
