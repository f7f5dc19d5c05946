"""tensorplay_mpi: uneven inputs on MPI without hangs (the Join API over mpi4py)."""

from . import comm, data
from .algorithms.join import Join, Joinable, JoinHook
from .comm import Work
from .parallel import DataParallel

__version__ = "0.1.0"

__all__ = ["DataParallel", "Join", "Joinable", "JoinHook", "Work", "comm", "data", "__version__"]
