"""Whether this MPI can survive a lost rank (ULFM: revoke, agree, shrink), decided at run time.

The functions exist in mpi4py 4 whatever the MPI (``Comm.Revoke``, ``Comm.Shrink``,
``Comm.Agree``, ``Comm.Get_failed``), but only an MPI built with User-Level Failure
Mitigation, and launched with it on, reports a lost rank to the survivors instead of ending the
job: Open MPI 5 under ``mpiexec --with-ft ulfm`` (which sets ``OMPI_MCA_mpi_ft_enable=1`` in
every rank's environment).  MPICH's wheels have the functions as stubs.  ``python -m
tensorplay_mpi.info`` prints the decision.

Where it says yes, a lost rank surfaces in the survivors' next MPI call as
``MPI_ERR_PROC_FAILED`` (or ``MPI_ERR_REVOKED``); :func:`is_process_failure` recognises it and
:func:`lost_rank_error` turns it into a :class:`~tensorplay_mpi.errors.PeerFailureError` that
names the lost ranks (the Join raises it on every survivor).  An elastic Join goes on without
them instead (:mod:`~tensorplay_mpi.comm._shrink`, :mod:`~tensorplay_mpi.algorithms._elastic`).
"""

from __future__ import annotations

import os
import time
from typing import Mapping

from mpi4py import MPI

from ..errors import PeerFailureError

FINALIZE_WATCHDOG_S = 20.0
"""Under a fault-tolerant launch, a process still exiting this long after the library's exit
hook ends with status 1 and a traceback: Open MPI's ``MPI_Finalize`` after a lost rank hung
once in about 80 runs here."""

FUNCTIONS = ("Revoke", "Shrink", "Agree", "Get_failed")
"""The ULFM methods of ``mpi4py.MPI.Comm`` that surviving a lost rank needs."""

_ON = ("1", "true", "yes", "on")
_FAILURES = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
DETECTION_S = 2.0
"""How long another MPI error waits for the communicator to know of a lost rank (measured:
under a second) before it is taken for what it says."""


def fault_tolerance(vendor: str | None = None,
                    environ: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """Whether a lost rank is reported to the survivors (ULFM), and why; local.

    Parameters
    ----------
    vendor, environ
        The MPI library's vendor (``MPI.get_vendor()[0]``) and the environment
        (``os.environ``), by default this process's.
    """
    missing = [name for name in FUNCTIONS if not hasattr(MPI.Comm, name)]
    if missing:
        return False, f"mpi4py {MPI.Get_version()} has no {', '.join(missing)} (mpi4py 4 has)"
    vendor = MPI.get_vendor()[0] if vendor is None else vendor
    environ = os.environ if environ is None else environ
    if vendor != "Open MPI":
        return False, (f"{vendor}: its ULFM functions end the job on a lost rank here (Open "
                       "MPI 5 under mpiexec --with-ft ulfm reports it instead)")
    if environ.get("OMPI_MCA_mpi_ft_enable", "").lower() not in _ON:
        return False, "Open MPI launched without --with-ft ulfm (OMPI_MCA_mpi_ft_enable unset)"
    return True, "Open MPI launched with --with-ft ulfm (OMPI_MCA_mpi_ft_enable=1)"


def is_process_failure(error: BaseException, comm: MPI.Comm | None = None) -> bool:
    """Whether `error` is MPI's report of a lost rank, under a launch with fault tolerance.

    ``MPI_ERR_PROC_FAILED``, ``MPI_ERR_PROC_FAILED_PENDING`` and ``MPI_ERR_REVOKED`` are
    (elsewhere mpi4py gives these names to a generic error class).  So is any other MPI error
    on `comm` once `comm` knows of a lost rank, within :data:`DETECTION_S`: Open MPI's
    nonblocking collectives reported a peer's death as ``MPI_ERR_TRUNCATE`` at 4 ranks here.
    """
    if not isinstance(error, MPI.Exception) or not fault_tolerance()[0]:
        return False
    if error.Get_error_class() in {getattr(MPI, name) for name in _FAILURES}:
        return True
    if comm is None:
        return False
    return bool(known_lost_ranks(comm))


def known_lost_ranks(comm: MPI.Comm) -> list[int]:
    """:func:`lost_ranks`, once `comm` knows of one, within :data:`DETECTION_S` (a survivor
    that learns of the loss from another's revocation may know of no lost rank yet)."""
    deadline = time.monotonic() + DETECTION_S
    while not (lost := lost_ranks(comm)) and time.monotonic() < deadline:
        MPI.COMM_SELF.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)  # drives MPI's progress (the
        time.sleep(0.001)  # failure detector's notices travel in it)
    return lost


def lost_ranks(comm: MPI.Comm) -> list[int]:
    """The ranks of `comm` this process knows to be lost (``MPI_Comm_get_failed``); local."""
    failed, mine = comm.Get_failed(), comm.Get_group()
    ranks = failed.Translate_ranks(None, mine)  # every member of the failed group
    for group in (failed, mine):
        group.Free()
    return sorted(r for r in ranks if r != MPI.UNDEFINED)


def lost_rank_error(comm: MPI.Comm, error: BaseException) -> PeerFailureError:
    """The error a survivor raises for a lost rank (`error`: MPI's report of it)."""
    return PeerFailureError(
        f"rank {comm.Get_rank()}: rank(s) {known_lost_ranks(comm)} of the communicator were lost "
        f"(the process is gone: {error}); the Join cannot go on without them, so the job "
        "ends: run the same command again to resume from the last periodic save (or make "
        "the Join elastic: Join(..., elastic=True))")
