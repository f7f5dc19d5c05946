"""tensorplay_mpi: uneven inputs on MPI without hangs (the Join API over mpi4py)."""

from . import comm, data, optim
from .algorithms.join import Join, Joinable, JoinHook
from .comm import Work
from .errors import CollectiveMismatchError, CollectiveTimeoutError, PeerFailureError
from .joinable_comm import JoinableComm
from .optim import SGD, Adam, AdamW, ZeroRedundancyOptimizer
from .parallel import DataParallel

__version__ = "0.1.0"

__all__ = [
    "CollectiveMismatchError", "CollectiveTimeoutError", "PeerFailureError", "SGD", "Adam", "AdamW", "DataParallel", "Join", "Joinable", "JoinHook", "JoinableComm", "Work",
    "ZeroRedundancyOptimizer", "comm", "data", "optim", "__version__",
]
