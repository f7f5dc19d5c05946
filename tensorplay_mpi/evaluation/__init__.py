"""Evaluation over uneven shards: metric states synced over MPI (:mod:`.metrics`, also
``tensorplay_mpi.metrics``) and ``SyncBatchNorm`` (:mod:`.sync_batchnorm`, imported on first
use of ``tensorplay_mpi.SyncBatchNorm``: it needs torch)."""

from __future__ import annotations

__all__ = ["sync_batchnorm_class"]


def sync_batchnorm_class() -> type:
    """:class:`~tensorplay_mpi.evaluation.sync_batchnorm.SyncBatchNorm`, importing torch; where
    torch cannot be imported, a stand-in that raises ``ImportError`` when used, so that
    ``from tensorplay_mpi import *`` works without the torch extra."""
    try:
        from .sync_batchnorm import SyncBatchNorm
    except ImportError as error:
        return _needs_torch(error)
    return SyncBatchNorm


def _needs_torch(error: ImportError) -> type:
    message = (f"SyncBatchNorm needs torch, which cannot be imported ({error}): install the "
               "torch extra, pip install 'tensorplay-mpi[torch]'")

    class SyncBatchNorm:
        """A stand-in: torch cannot be imported here (using it raises ``ImportError``)."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            raise ImportError(message)

        @classmethod
        def convert_sync_batchnorm(cls, *args: object, **kwargs: object) -> None:
            raise ImportError(message)
    return SyncBatchNorm
