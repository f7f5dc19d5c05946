"""Optimizers: local SGD, Adam, AdamW and the sharded ZeroRedundancyOptimizer (all Joinables),
gradient clipping over ranks, and the protocol a checkpoint saves an optimizer through."""

from ._clip import clip_grad_norm
from ._local import SGD, Adam, AdamW, Optimizer
from ._protocol import OptimizerState
from ._zero import ZeroRedundancyOptimizer

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "ZeroRedundancyOptimizer", "clip_grad_norm",
           "OptimizerState"]
