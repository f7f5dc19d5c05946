"""Evaluation metrics over uneven shards: the public path of
:mod:`tensorplay_mpi.evaluation.metrics` (``from tensorplay_mpi.metrics import ...``)."""

from .evaluation.metrics import (StatesDiffer, SyncGroup, confusion_matrix, distributed_available,
                                 gather_all_tensors, reduce_states, sync_options)

__all__ = ["gather_all_tensors", "distributed_available", "sync_options", "SyncGroup",
           "reduce_states", "StatesDiffer", "confusion_matrix"]
