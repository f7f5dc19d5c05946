"""tensorplay_mpi: uneven inputs on MPI without hangs (the Join API over mpi4py)."""

from typing import TYPE_CHECKING

from . import checkpoint, comm, data, optim
from .algorithms import ElasticJoinable, Join, Joinable, JoinableComm, JoinHook
from .comm import Work
from .errors import (CollectiveMismatchError, CollectiveTimeoutError, EarlyTerminationError,
                     PeerFailureError, RanksLostError)
from .optim import SGD, Adam, AdamW, ZeroRedundancyOptimizer
from .parallel import DataParallel
from ._process import exit_for_requeue
from .stopping import (clear_save, clear_stop, keep_stop_signals, request_save, request_stop,
                       save_requested, stop_on_signals, stop_requested)

if TYPE_CHECKING:  # imported on first use (below): it needs torch
    from .evaluation._sync_batchnorm import SyncBatchNorm

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``SyncBatchNorm`` on first use: ``import tensorplay_mpi`` does not import torch (a
    ``from tensorplay_mpi import *`` does where it is installed, as it takes every name of
    ``__all__``; without torch it gets a stand-in that raises ``ImportError`` when used)."""
    if name == "SyncBatchNorm":
        from . import evaluation
        return evaluation.SyncBatchNorm
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "SyncBatchNorm"])

__all__ = [
    "Join", "Joinable", "JoinHook", "ElasticJoinable", "Work", "DataParallel", "JoinableComm",
    "SyncBatchNorm",
    "SGD", "Adam", "AdamW", "ZeroRedundancyOptimizer",
    "CollectiveMismatchError", "CollectiveTimeoutError", "EarlyTerminationError",
    "PeerFailureError", "RanksLostError", "stop_on_signals", "request_stop", "stop_requested",
    "clear_stop",
    "request_save", "save_requested", "clear_save", "keep_stop_signals", "exit_for_requeue",
    "checkpoint", "comm", "data", "optim", "__version__",
]
