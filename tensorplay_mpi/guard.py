"""The guard of a communicator: failure notices and agreement, debug checks, launch check.

A Guard is attached (as an MPI attribute, freed with the communicator) to every communicator
that a Join, a DataParallel or a ZeroRedundancyOptimizer uses.  It owns two private duplicates:

``notices``
    A rank that leaves a Join or a step through an exception sends a notice (its rank, whether
    the failure is its own, the exception's type and message) to every other rank.  Every
    library wait on the guarded communicator looks for notices and raises
    :class:`~tensorplay_mpi.errors.PeerFailureError`, which sends notices in turn.  Each failing
    rank then joins the failure agreement, ``Iallreduce([own failure], SUM)`` on ``notices``,
    and receives the notices of all other ranks.  When every rank failed on its own (one bug
    on all ranks) the communicator is intact: pending requests are completed and each rank's
    exception propagates unchanged.  Otherwise it is broken: the exceptions propagate (with
    ``python -m mpi4py`` the job aborts) and later library collectives on it raise at once.
``checks``
    With ``TENSORPLAY_MPI_DEBUG=1``, before every library collective the ranks allgather its
    signature (kind, count, dtype, op, root) and raise
    :class:`~tensorplay_mpi.errors.CollectiveMismatchError` on every rank if they differ.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

from .comm import GUARD_KEYVAL, Work, default_timeout
from .errors import CollectiveMismatchError, PeerFailureError

__all__ = ["Guard", "check_launch", "DEBUG"]

DEBUG = os.environ.get("TENSORPLAY_MPI_DEBUG", "0") == "1"
"""Collective signature checks before every library collective (``TENSORPLAY_MPI_DEBUG=1``)."""

GRACE_S = 0.25
"""Seconds a wait goes on after a failure notice before it raises PeerFailureError."""

_NOTICE_TAG = 0x7E11
_SIGNATURE_BYTES = 96  # per part: the signature compared, and what it is for (shown)
_LAUNCH_VARIABLES = ("SLURM_STEP_NUM_TASKS", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
_COLLECTIVES = ("allreduce", "bcast", "allgather")


def check_launch() -> None:
    """Raise if the launcher started several tasks but each one is a singleton MPI job.

    That is what a wrong ``srun --mpi`` plugin (or an mpiexec from another MPI) does.

    Raises
    ------
    RuntimeError
        Naming the variable that counts the tasks and the plugins to use.
    """
    if MPI.COMM_WORLD.Get_size() > 1:
        return
    for name in _LAUNCH_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            raise RuntimeError(
                f"MPI.COMM_WORLD has 1 rank but {name}={value}: every task started as a "
                "singleton MPI job, so the launcher does not speak this MPI library's process "
                "manager interface. Under Slurm use srun --mpi=pmi2 (MPICH, Intel MPI, MVAPICH) "
                "or srun --mpi=pmix (Open MPI); 'srun --mpi=list' shows the plugins. With "
                "mpiexec, use the one of the MPI library that mpi4py loads "
                "(python -m tensorplay_mpi.info)."
            )


def _idup(comm: MPI.Intracomm) -> MPI.Intracomm:
    dup, request = comm.Idup()
    request.Wait()
    return dup


class Guard:
    """Failure notices, failure agreement and debug checks of one communicator."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.notices = _idup(comm)
        self.checks = _idup(comm)
        self.received: list[tuple] = []  # notices of the failure being settled
        self._first_notice: float | None = None
        self.broken: str | None = None

    @classmethod
    def attach(cls, comm: MPI.Intracomm) -> "Guard":
        """The guard of `comm`, made on first use.

        Collective over `comm` the first time: every rank must call it.
        """
        guard = comm.Get_attr(GUARD_KEYVAL)
        if guard is None:
            check_launch()
            guard = cls(comm)
            comm.Set_attr(GUARD_KEYVAL, guard)
        return guard

    def free(self) -> None:
        """Free the private communicators (called when the guarded one is freed)."""
        if not MPI.Is_finalized():
            self.notices.Free()
            self.checks.Free()

    # -- every library collective ----------------------------------------------------------

    def before_collective(self, kind: str, what: str,
                          signature: Callable[[], str] | None) -> None:
        """Refuse a broken communicator; in debug mode, check that every rank issues the same."""
        if self.broken is not None:
            raise RuntimeError(f"rank {self.rank}: cannot start {what}: the communicator is "
                               f"unusable after {self.broken}; end the job")
        if DEBUG and kind in _COLLECTIVES and signature is not None:
            self._check_signatures(signature(), what)

    def _check_signatures(self, signature: str, what: str) -> None:
        mine = np.zeros((2, _SIGNATURE_BYTES), np.uint8)
        for row, text in enumerate((signature, what)):
            data = text.encode()[:_SIGNATURE_BYTES]
            mine[row, :len(data)] = np.frombuffer(data, np.uint8)
        every = np.empty((self.size, 2, _SIGNATURE_BYTES), np.uint8)
        Work(self.checks.Iallgather(mine, every), f"signature check before {what}",
             (mine, every), None, self).wait_or_abort(default_timeout())
        if (every[:, 0] != every[0, 0]).any():
            rows = [f"  rank {r}: {_text(every[r, 0])}  [{_text(every[r, 1])}]"
                    for r in range(self.size)]
            raise CollectiveMismatchError(
                "ranks are about to issue different collectives on one communicator:\n"
                + "\n".join(rows))

    def poll(self, what: str, since: float) -> None:
        """Raise PeerFailureError once another rank's failure notice is older than the grace.

        The grace (:data:`GRACE_S`, counted from the notice or from `since`, the start of the
        current wait, whichever is later) lets an operation that the failed rank had already
        started complete: when every rank fails at the same point after a collective, each
        rank then raises its own exception, not a PeerFailureError, and the communicator stays
        usable.
        """
        status = MPI.Status()
        while self.notices.Iprobe(MPI.ANY_SOURCE, _NOTICE_TAG, status):
            self.received.append(self.notices.recv(source=status.Get_source(), tag=_NOTICE_TAG))
            if self._first_notice is None:
                self._first_notice = time.monotonic()
        if self.received and time.monotonic() - max(self._first_notice, since) > GRACE_S:
            rank, _, kind, message = self.received[0]
            raise PeerFailureError(f"rank {self.rank}: rank {rank} failed with {kind}: "
                                   f"{message} (while this rank waited for {what})")

    # -- the failure path ------------------------------------------------------------------------

    def settle(self, error: BaseException, timeout: float) -> bool:
        """Tell every rank about `error`, agree, and say whether the communicator is intact.

        Called by every rank that leaves a Join or a step through an exception; the verdict is
        remembered on the exception, so an exception that leaves a step and then its Join is
        settled once.

        Returns
        -------
        bool
            True iff every rank failed on its own: pending requests can be completed.
        """
        verdict = getattr(error, "_tensorplay_mpi_intact", None)
        if verdict is not None:
            return verdict
        own = not isinstance(error, PeerFailureError)
        notice = (self.rank, own, type(error).__name__, str(error))
        sends = [self.notices.isend(notice, dest=r, tag=_NOTICE_TAG)
                 for r in range(self.size) if r != self.rank]
        count = np.array([int(own)], np.int64)
        Work(self.notices.Iallreduce(MPI.IN_PLACE, count, MPI.SUM), "failure agreement",
             (count,)).wait_or_abort(timeout, poll=False)
        while len(self.received) < self.size - 1:  # all were sent before the agreement ended
            self.received.append(self.notices.recv(source=MPI.ANY_SOURCE, tag=_NOTICE_TAG))
        MPI.Request.Waitall(sends)
        intact = int(count[0]) == self.size
        if not intact:
            failed = sorted(r for r, was_own, _, _ in self.received if was_own)
            failed += [self.rank] if own else []
            self.broken = f"a failure on rank(s) {sorted(failed)} that other ranks did not share"
        self.received.clear()
        self._first_notice = None
        try:
            error._tensorplay_mpi_intact = intact  # type: ignore[attr-defined]
        except AttributeError:
            pass
        return intact


def _text(row: np.ndarray) -> str:
    return row.tobytes().rstrip(b"\0").decode(errors="replace")

