"""Optimizers: local SGD, Adam, AdamW and the sharded ZeroRedundancyOptimizer (all Joinables)."""

from .clip import clip_grad_norm
from .local import SGD, Adam, AdamW, Optimizer
from .zero import ZeroRedundancyOptimizer

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "ZeroRedundancyOptimizer", "clip_grad_norm"]
