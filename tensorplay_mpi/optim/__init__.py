"""Optimizers: local SGD, Adam, AdamW, and the sharded ZeroRedundancyOptimizer (a Joinable)."""

from .local import SGD, Adam, AdamW, Optimizer
from .zero import ZeroRedundancyOptimizer

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "ZeroRedundancyOptimizer"]
