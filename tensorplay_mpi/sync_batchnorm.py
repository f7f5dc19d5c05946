"""``SyncBatchNorm`` (imports torch): the path :mod:`tensorplay_mpi.evaluation.sync_batchnorm`
had before the package's folders, kept for code and pickled models (``torch.save``) that name
it; new code writes ``tensorplay_mpi.SyncBatchNorm``."""

from .evaluation.sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
