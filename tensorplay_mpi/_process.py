"""The process: what tensorplay_mpi sets up once per process, how it ends, and its state.

:func:`set_up` is the one call that prepares the process; every entry point makes it (a Join
entering, a library joinable or optimizer made, a checkpoint saved or loaded), and no lower
layer imports this module.  It

1. reads the settings (a bad ``TENSORPLAY_MPI_*`` value raises here, before anything starts);
2. checks the launch: a job whose every task started as a singleton MPI job (a wrong
   ``srun --mpi`` plugin, an mpiexec from another MPI) raises ``RuntimeError`` saying so;
3. installs, once, an excepthook that aborts the job on an uncaught exception, where nothing
   else does (:func:`install_excepthook`);
4. limits the BLAS/OpenMP threads of the process, from ``settings().threads``
   (:mod:`tensorplay_mpi._threads`).

Its teardown is one exit hook, registered when this module is imported (after mpi4py's own, so
that it runs before ``MPI_Finalize``): the operations still pending in the registry of
:mod:`tensorplay_mpi.comm._work` are completed, or the job is aborted if they never can be; then
the persistent requests still kept are freed (:func:`tensorplay_mpi.comm._persistent.free_all`),
and the stop signals of :func:`~tensorplay_mpi.stopping.keep_stop_signals` are ignored from
then on (a signal during ``MPI_Finalize`` would otherwise end a finished job with its default
action).  A program that calls ``MPI.Finalize()`` itself (a stop's exit with status 75) gets the
first two from within it: an attribute on ``COMM_SELF``, set once, whose delete callback
``MPI_Finalize`` runs before it finalizes.  After an uncaught exception under ``python -m
mpi4py`` (its traceback printed, the job about to be aborted), operations still pending abort
the job without a report of their own: they belong to the failure already printed.  Under a
fault-tolerant launch (ULFM) ``MPI_Finalize`` skips Open MPI's PMIx fence, which waited for the
lost ranks too (:func:`_skip_finalize_fence`), and after a lost rank the hook finalizes MPI
itself, under its watchdog (:func:`_finalize_after_a_loss`).

An uncaught exception on one rank of a multi-rank job, outside any library call, leaves the
other ranks waiting in their next collective until their deadline.  ``python -m mpi4py``, the
documented launch, turns it into ``MPI_Abort``, and so does the excepthook for programs started
without it (``TENSORPLAY_MPI_EXCEPTHOOK=0`` keeps Python's own).  A ``sys.exit(status)`` with
a nonzero status is not an exception Python hands to any hook: ``python -m mpi4py`` aborts on
it (``raise SystemExit(status)`` included), a program started without it does not.  The library
does not replace ``sys.exit`` to see it: a process-wide replacement of a builtin would surprise
every other library in the process, would not see ``raise SystemExit``, and would need
forgetting a caught exit (argparse's) to not abort a job that went on.  Launch with
``python -m mpi4py``.

The excepthook is process-wide state that :func:`tensorplay_mpi.testing.reset_process_state`
resets (registered with :mod:`tensorplay_mpi._resets`); docs/api/index.md lists every piece of
the library's process-wide state.
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import os
import sys
import time
from types import TracebackType
from typing import Any, Callable, NoReturn

from mpi4py import MPI

from ._resets import register
from .comm._fault_tolerance import FINALIZE_WATCHDOG_S, fault_tolerance
from .comm._persistent import free_all
from .comm._work import complete_all_at_exit, outstanding_requests, spin_on_own_core
from .settings import settings
from .stopping import REQUEUE_STATUS, ignore_kept_signals
from ._threads import limit_threads, oversubscribed

_LAUNCH_VARIABLES = ("SLURM_STEP_NUM_TASKS", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
_REPORT_GRACE_S = 0.5  # the launcher forwards the traceback before the abort kills the job
_previous_hook: Callable[..., Any] | None = None  # sys.excepthook before ours, while ours is on


def set_up(comm: MPI.Intracomm | None = None) -> None:
    """Prepare this process for the library (see the module docstring); cheap after the first.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm, optional
        A communicator every rank of which calls this now (a Join entering, a joinable made):
        the ranks on this node are counted over it, once, for the thread limit.  ``None``: not
        a collective call (an optimizer made), and only the user's thread choice applies.

    Raises
    ------
    ValueError
        If a ``TENSORPLAY_MPI_*`` variable holds a value it does not accept.
    RuntimeError
        If every task of the job started as a singleton MPI job.
    """
    current = settings()
    _free_at_finalize()
    _skip_finalize_fence()
    check_launch()
    if current.excepthook:
        install_excepthook()
    limit_threads(comm, setting=current.threads)
    if comm is not None:  # the ranks on this node are counted: a wait may spin longer
        spin_on_own_core(not oversubscribed())


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
    """Abort the job on an uncaught exception, once per process, where nothing else does.

    Installed only when ``COMM_WORLD`` has several ranks and the program does not run under
    ``python -m mpi4py`` (whose handler already aborts).  The hook prints the traceback as the
    previous hook would, then calls ``MPI_Abort``.
    """
    global _previous_hook
    if _previous_hook is not None or MPI.COMM_WORLD.Get_size() == 1 \
            or "mpi4py.run" in sys.modules:
        return
    _previous_hook = sys.excepthook
    sys.excepthook = _abort_on_uncaught


def _uninstall_excepthook() -> None:
    global _previous_hook
    if _previous_hook is not None and sys.excepthook is _abort_on_uncaught:
        sys.excepthook = _previous_hook
    _previous_hook = None


register(_uninstall_excepthook)


def _abort_on_uncaught(kind: type[BaseException], error: BaseException,
                       tb: TracebackType | None) -> None:
    previous = _previous_hook if callable(_previous_hook) else sys.__excepthook__
    previous(kind, error, tb)
    sys.stderr.write(f"rank {MPI.COMM_WORLD.Get_rank()}: uncaught {kind.__name__}: aborting "
                     "the MPI job so that the other ranks do not wait for this one "
                     "(tensorplay_mpi; TENSORPLAY_MPI_EXCEPTHOOK=0 turns this off)\n")
    sys.stderr.flush()
    time.sleep(_REPORT_GRACE_S)
    MPI.COMM_WORLD.Abort(1)


def _at_exit() -> None:
    """The exit hook: complete the pending operations (or abort), free the persistent
    requests still kept, and ignore the stop signals that keep_stop_signals() kept (Python
    gives them their default action back before mpi4py finalizes MPI); under a fault-tolerant
    launch, first arm the exit's watchdog (:data:`~tensorplay_mpi.comm._fault_tolerance.
    FINALIZE_WATCHDOG_S`) and, after a lost rank, finalize MPI under it.  After an uncaught
    exception that ``python -m mpi4py`` printed, operations still pending end the job without a
    report of their own (:func:`_abort_quietly_after`)."""
    if fault_tolerance()[0]:  # the exit after a lost rank: never a silent hang
        faulthandler.dump_traceback_later(FINALIZE_WATCHDOG_S, exit=True)
    _abort_quietly_after(_uncaught_under_mpi4py())
    complete_all_at_exit()
    free_all()
    ignore_kept_signals()
    _finalize_after_a_loss()


def _uncaught_under_mpi4py() -> BaseException | None:
    """The uncaught exception that ends this process, where ``python -m mpi4py`` runs it
    (it has printed the traceback and aborts the job after the exit hooks), else ``None``."""
    if "mpi4py.run" not in sys.modules:
        return None
    error = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return error if isinstance(error, BaseException) else None


def _abort_quietly_after(error: BaseException | None) -> None:
    """Abort the job, printing nothing, when `error` ends the process (its traceback is this
    rank's message) and library operations are still pending: they belong to that failure (a
    communicator it left unusable, peers that will not match them), and the job ends anyway;
    a report of them, or a wait for them, would only bury the error."""
    if error is None or not outstanding_requests():
        return
    status = 130 if isinstance(error, KeyboardInterrupt) else 1  # as mpi4py's abort
    time.sleep(_REPORT_GRACE_S)  # the launcher forwards every rank's traceback first
    MPI.COMM_WORLD.Abort(status)
    os._exit(status)  # MPICH's MPI_Abort returns on a rank whose job another rank aborts


def _at_finalize(comm: MPI.Comm, keyval: int, value: object) -> None:
    """The delete callback of this process's attribute on ``COMM_SELF``: ``MPI_Finalize``
    deletes those first, so an explicit ``MPI.Finalize()`` (docs/stopping.md) completes the
    pending operations and frees the persistent requests before MPI finalizes, as the exit
    hook does for an implicit one (where mpi4py no longer calls Python)."""
    complete_all_at_exit()
    free_all()


_finalize_keyval: int | None = None


def _free_at_finalize() -> None:
    """Set the ``COMM_SELF`` attribute whose deletion runs :func:`_at_finalize`, once, where
    MPI is initialized (at import, else at the first :func:`set_up`)."""
    global _finalize_keyval
    if _finalize_keyval is None and MPI.Is_initialized() and not MPI.Is_finalized():
        _finalize_keyval = MPI.Comm.Create_keyval(delete_fn=_at_finalize)
        MPI.COMM_SELF.Set_attr(_finalize_keyval, True)


_fence_checked = False


def _skip_finalize_fence() -> None:
    """Under a fault-tolerant Open MPI launch, once: ``MPI_Finalize`` skips its PMIx fence
    (Open MPI's ``async_mpi_finalize``, set in ``libmpi`` at run time; MCA parameters are read
    at ``MPI_Init``).  That fence spans every process of the job, the lost ones included, and
    hung the survivors after a lost rank (Open MPI 5.0.11, about 1 job in 12 here); ULFM's
    ``MPI_Finalize`` agrees and synchronises the survivors before it anyway.  Elsewhere (another
    MPI, a ``libmpi`` without the variable) nothing changes."""
    global _fence_checked
    if _fence_checked or not fault_tolerance()[0]:
        return
    _fence_checked = True
    try:
        with open("/proc/self/maps") as maps:
            path = next(line.split(None, 5)[-1].strip() for line in maps if "/libmpi.so" in line)
        libmpi = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        ctypes.c_bool.in_dll(libmpi, "ompi_async_mpi_finalize").value = True
    except (OSError, StopIteration, ValueError, IndexError):
        pass  # the fence stays; docs/elastic.md: mpiexec --mca async_mpi_finalize 1


def _finalize_after_a_loss() -> None:
    """After a lost rank (fault tolerance on, ``COMM_WORLD`` knows a failed process):
    ``MPI_Finalize`` here, under the exit's watchdog.  mpi4py's own runs after Python has
    shut the watchdog down (``faulthandler`` ends before ``Py_AtExit`` functions run), where a
    hang would be silent."""
    if not fault_tolerance()[0] or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    try:
        failed = MPI.COMM_WORLD.Get_failed()
        lost = failed.Get_size() > 0
        failed.Free()
    except MPI.Exception:
        return
    if lost:
        MPI.Finalize()


def exit_for_requeue(status: int = REQUEUE_STATUS) -> NoReturn:
    """End this process with `status` (75 by default), MPI finalized first, cleanly.

    Call it on every rank once the stop's checkpoint is written (``MPI_Finalize`` is
    collective).  The library completes its pending operations and frees its persistent
    collectives as MPI finalizes, so the job ends with its own output only; under ``python -m
    mpi4py`` a nonzero exit without it would call ``MPI_Abort``, which ``srun`` reports as
    "Killed" (137), losing the status.  Under a fault-tolerant launch the finalize runs under
    the exit's watchdog, never a silent hang.

    A rank that calls it while its peers do not (they go on working) waits for them in
    ``MPI_Finalize``; after :data:`EXIT_WATCHDOG_S` it prints where it is and exits with status
    1 instead of hanging silently.

    Raises
    ------
    SystemExit
        With `status`, after MPI is finalized.
    TypeError
        If `status` is not an int (a string read from the environment, say).
    ValueError
        If `status` is not an exit status (0 to 255).
    RuntimeError
        Inside a running Join: MPI cannot be finalized under its pending operations; call it
        after the ``with`` block.
    """
    if isinstance(status, bool) or not isinstance(status, int):
        raise TypeError(f"exit_for_requeue() takes an int status, got {status!r}")
    if not 0 <= status <= 255:
        raise ValueError(f"exit_for_requeue() takes an exit status from 0 to 255, got {status}")
    join = sys.modules.get("tensorplay_mpi.algorithms.join")  # not imported by this layer
    if join is not None and join._running:
        raise RuntimeError("exit_for_requeue() inside a running Join: call it after the `with "
                           "Join(...)` block (on every rank), once the checkpoint is written")
    sys.stdout.flush()
    sys.stderr.flush()
    if MPI.Is_initialized() and not MPI.Is_finalized():
        faulthandler.dump_traceback_later(
            FINALIZE_WATCHDOG_S if fault_tolerance()[0] else EXIT_WATCHDOG_S, exit=True)
        MPI.Finalize()
    sys.exit(status)


EXIT_WATCHDOG_S = 120.0
"""How long :func:`exit_for_requeue` waits in ``MPI_Finalize`` for the other ranks (they call
it at the same point after a stop: their checkpoint writes are done) before it prints where
it is and exits with status 1."""


atexit.register(_at_exit)  # after mpi4py's own: runs before MPI_Finalize
_free_at_finalize()
_skip_finalize_fence()
