"""Data parallelism: ``DataParallel`` averages gradients in buckets as a Joinable; its
``dp.grads`` are ``GradientViews`` (the link to the optimizer that steps with them)."""

from ._data_parallel import DataParallel
from ._gradient_link import GradientViews

__all__ = ["DataParallel", "GradientViews"]
