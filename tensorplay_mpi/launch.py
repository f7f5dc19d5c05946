"""How the job was launched and how it ends: the launch check and the abort on uncaught errors.

An uncaught exception on one rank of a multi-rank job, outside any library call, leaves the
other ranks waiting in their next collective until the launcher's time limit, and so does a
``sys.exit(status)`` with a nonzero status.  ``python -m mpi4py`` turns both into
``MPI_Abort``; for programs started without it, the first Join or library joinable installs an
excepthook and a ``sys.exit`` that do the same (``TENSORPLAY_MPI_EXCEPTHOOK=0`` keeps Python's
own).  Python tells no exit hook the status of an uncaught ``SystemExit``, so the library sees
the status of the latest ``sys.exit`` call of the main thread; a ``raise SystemExit(status)``
of your own is not seen (``python -m mpi4py`` sees it), and a ``sys.exit`` that was caught is
forgotten at the next Join or joinable; one caught after the last of them still ends the job
with its status (``python -m mpi4py``, or ``TENSORPLAY_MPI_EXCEPTHOOK=0``, if your program
catches ``sys.exit`` and goes on).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from types import TracebackType

from mpi4py import MPI

from .settings import settings

__all__ = ["launch_problem", "check_launch", "install_excepthook", "forget_exit_status"]

_LAUNCH_VARIABLES = ("SLURM_STEP_NUM_TASKS", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
_REPORT_GRACE_S = 0.5  # the launcher forwards the traceback before the abort kills the job
_installed = False
_exit_status = 0  # of the latest sys.exit() call (0: none, or forgotten)


def launch_problem() -> str | None:
    """Why this process looks like one of several tasks each started as a singleton MPI job
    (a wrong ``srun --mpi`` plugin, or an mpiexec from another MPI), else ``None``."""
    if MPI.COMM_WORLD.Get_size() > 1:
        return None
    for name in _LAUNCH_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            return (
                f"MPI.COMM_WORLD has 1 rank but {name}={value}: every task started as a "
                "singleton MPI job, so the launcher does not speak this MPI library's process "
                "manager interface. Under Slurm use srun --mpi=pmi2 (MPICH, Intel MPI, MVAPICH) "
                "or srun --mpi=pmix (Open MPI); 'srun --mpi=list' shows the plugins. With "
                "mpiexec, use the one of the MPI library that mpi4py loads "
                "(python -m tensorplay_mpi.info)."
            )
    return None


def check_launch() -> None:
    """Raise ``RuntimeError`` with :func:`launch_problem`'s explanation, if there is one."""
    problem = launch_problem()
    if problem is not None:
        raise RuntimeError(problem)


def install_excepthook() -> None:
    """Abort the job on an uncaught exception or a nonzero ``sys.exit``, once per process,
    where nothing else does.

    Installed only when ``COMM_WORLD`` has several ranks, the program does not run under
    ``python -m mpi4py`` (whose handler already aborts), and ``TENSORPLAY_MPI_EXCEPTHOOK`` is
    not 0.  The hook prints the traceback as Python would, then calls ``MPI_Abort``; a process
    whose latest ``sys.exit`` had a nonzero status calls ``MPI_Abort`` with that status when it
    exits (before MPI finalizes).
    """
    global _installed
    if _installed or MPI.COMM_WORLD.Get_size() == 1 or "mpi4py.run" in sys.modules \
            or not settings().excepthook:
        return
    _installed = True
    previous = sys.excepthook

    def abort_on_uncaught(kind: type[BaseException], error: BaseException,
                          tb: TracebackType | None) -> None:
        previous(kind, error, tb)
        _abort(f"uncaught {kind.__name__}", 1)

    exit_ = sys.exit

    def recording_exit(status: str | int | None = None) -> None:
        global _exit_status
        if threading.current_thread() is threading.main_thread():  # elsewhere it ends a thread
            _exit_status = 0 if status is None else status if isinstance(status, int) else 1
        exit_(status)

    sys.excepthook = abort_on_uncaught
    sys.exit = recording_exit  # type: ignore[assignment]
    atexit.register(_abort_on_failed_exit)  # after mpi4py's: runs before MPI finalizes


def forget_exit_status() -> None:
    """Forget the latest ``sys.exit`` status: the program went on (a Join, the test session's
    end), so that exit was caught."""
    global _exit_status
    _exit_status = 0


def _abort_on_failed_exit() -> None:
    if _exit_status and not MPI.Is_finalized():
        _abort(f"sys.exit({_exit_status})", _exit_status)


def _abort(why: str, status: int) -> None:
    sys.stderr.write(f"rank {MPI.COMM_WORLD.Get_rank()}: {why}: aborting the MPI job so that "
                     "the other ranks do not wait for this one (tensorplay_mpi; "
                     "TENSORPLAY_MPI_EXCEPTHOOK=0 turns this off)\n")
    sys.stderr.flush()
    time.sleep(_REPORT_GRACE_S)
    MPI.COMM_WORLD.Abort(status)
