"""Shrinking a communicator to its survivors after a lost rank (ULFM): revoke, release, shrink.

Under an MPI with fault tolerance (:mod:`~tensorplay_mpi.comm.fault_tolerance`), a survivor
revokes the communicator so that every other survivor's pending and later operations on it
end in ``MPI_ERR_REVOKED`` (none of them waits for the dead), releases the library's own
operations on it (each ends in error, its buffers are let go, the exit hook finds nothing
pending), and shrinks it: ``MPI_Comm_shrink`` agrees on who is alive and gives the survivors a
communicator of their own.
"""

from __future__ import annotations

import time
from typing import cast

from mpi4py import MPI

from .guard import Guard
from .work import pending_of

__all__ = ["shrink"]


def shrink(comm: MPI.Intracomm, grace: float) -> tuple[MPI.Intracomm, list[int]]:
    """Revoke `comm`, release the library's operations on it, and shrink it.

    Collective over the survivors of `comm`: each must call it (a survivor learns of the loss
    in its next operation on `comm`, which the revocation ends at once).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The communicator that lost ranks.
    grace : float
        Seconds to wait for the library's operations on it to end in error; those still
        pending then are dropped (their communicator is unusable, MPI never completes them).

    Returns
    -------
    (mpi4py.MPI.Intracomm, list of int)
        The survivors' communicator, and the lost ranks numbered in `comm` (the same on every
        survivor).
    """
    guard = Guard.of(comm)
    for each in [comm, *(guard.private() if guard is not None else [])]:
        each.Revoke()
    if guard is not None:
        guard.broken = guard.broken or "the loss of a rank (revoked, shrunk to the survivors)"
        _release(guard, grace)
    survivors = cast(MPI.Intracomm, comm.Shrink())  # an intra-communicator's is one too
    return survivors, _lost(comm, survivors)


def _release(guard: Guard, grace: float) -> None:
    """Complete every library operation on `guard`'s communicators: revoked, each ends in
    error; any left after `grace` s is dropped."""
    deadline = time.monotonic() + grace
    why = "the operation ended when a lost rank's communicator was revoked"
    while True:
        left = [work for work in pending_of(guard) if not work.release_if_failed(why)]
        if not left:
            return
        if time.monotonic() > deadline:
            for work in left:
                work.abandon(why)
            return
        time.sleep(0.001)


def _lost(comm: MPI.Intracomm, survivors: MPI.Intracomm) -> list[int]:
    """The ranks of `comm` that are not in `survivors`."""
    old, new = comm.Get_group(), survivors.Get_group()
    gone = MPI.Group.Difference(old, new)
    try:
        return sorted(gone.Translate_ranks(None, old))
    finally:
        for group in (old, new, gone):
            group.Free()
