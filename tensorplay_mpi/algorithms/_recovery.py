"""A Join's failure path: the replica check on entry, the failure agreement and cleanup when an
iteration raises, and a lost rank's error or, in an elastic Join, the survivors' recovery."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from mpi4py import MPI

from ..comm._fault_tolerance import fault_tolerance, is_process_failure, lost_rank_error
from ..comm._guard import Guard
from ..comm._shrink import none_lost, revoke
from ..comm._work import complete_pending
from .._replicas import check_replicas
from ..settings import settings
from ._elastic import check_elastic, progress, recover


class Recovery:
    """What a Join does about failures on `comm`, for its `joinables`.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The Join's communicator.
    joinables : sequence of Joinable
        The Join's joinables, in list order.
    elastic : bool
        Go on without lost ranks (checked here: every joinable must be elastic).
    timeout : float
        The deadline of each wait.
    """

    def __init__(self, comm: MPI.Intracomm, joinables: Sequence[Any], elastic: bool,
                 timeout: float) -> None:
        if elastic:
            check_elastic(joinables)
        self._comm, self._joinables = comm, list(joinables)
        self.elastic, self._timeout = elastic, timeout
        self._entered_progress = 0  # updates applied when the Join was entered (elastic)
        self._guard: Guard | None = None

    def enter(self, enabled: bool) -> None:
        """On the Join's entry: attach the guard (collective over the communicator); after a
        failure every rank caught at one point, check that replicas still agree."""
        self._guard = Guard.attach(self._comm)
        if enabled and self._guard.replica_check_due:
            self._guard.replica_check_due = False
            check_replicas(self._comm, self._joinables, self._timeout)
        if self.elastic:
            self._entered_progress = progress(self._joinables) or 0  # not None: checked

    def handle_failure(self, error: BaseException,
                       forget_heartbeats: Callable[[], None]) -> None:
        """The failure path: agree with every rank; when every rank failed on its own,
        complete every operation still pending on the communicator (of any joinable), so
        nothing leaks into the next Join.  A lost rank (MPI reports it under ULFM) raises
        :class:`~tensorplay_mpi.errors.PeerFailureError` naming it instead of MPI's error,
        or, when elastic, :class:`~tensorplay_mpi.errors.RanksLostError` once the survivors
        go on without it."""
        if self._guard is not None and self._guard.agree_on_failure(error).intact:
            forget_heartbeats()
            complete_pending(self._guard, self._timeout)
        if is_process_failure(error, self._comm):
            forget_heartbeats()
            if self.elastic:
                raise recover(self._comm, self._joinables, error, self._timeout,
                              self._entered_progress) from error
            failure = lost_rank_error(self._comm, error)
            revoke(self._comm, settings().grace)  # nothing left pending: the exit is clean
            raise failure from error

    def agree_on_the_end(self) -> None:
        """An elastic Join under fault tolerance ends on every rank alike: a rank lost before
        every survivor left it (in the post hooks, say) is recovered from on every survivor."""
        if self.elastic and fault_tolerance()[0] and not none_lost(self._comm):
            raise recover(self._comm, self._joinables, None, self._timeout,
                          self._entered_progress, agreed=True)

    def exit(self) -> None:
        """On the Join's exit, whatever happened: forget the exception agreed on (its frames and
        their objects), answer stall questions that came while this rank computed, and drop
        the joinables."""
        if self._guard is not None:
            self._guard.forget_failure()
            self._guard.drain()
        self._joinables = []
