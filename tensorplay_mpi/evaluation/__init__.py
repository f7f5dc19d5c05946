"""Evaluation over uneven shards: metric states synced over MPI
(:mod:`tensorplay_mpi.evaluation.metrics`: torchmetrics' sync function, NumPy metric states)
and ``SyncBatchNorm`` for torch models, imported on first use (it needs torch; also
``tensorplay_mpi.SyncBatchNorm``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported on first use (below): it needs torch
    from ._sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]


def __getattr__(name: str) -> object:
    """``SyncBatchNorm`` on first use, importing torch; where torch cannot be imported, a
    stand-in that raises ``ImportError`` when used, so that ``from tensorplay_mpi import *``
    works without the torch extra."""
    if name == "SyncBatchNorm":
        return _sync_batchnorm_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "SyncBatchNorm"])


def _sync_batchnorm_class() -> type:
    try:
        from ._sync_batchnorm import SyncBatchNorm
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
