"""tensorplay_mpi: uneven inputs on MPI without hangs (the Join API over mpi4py)."""

from . import comm
from .algorithms.join import Join, Joinable, JoinHook
from .comm import Work

__version__ = "0.1.0"

__all__ = ["Join", "Joinable", "JoinHook", "Work", "comm", "__version__"]
