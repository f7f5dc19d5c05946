"""Shrinking a communicator to its survivors after a lost rank (ULFM): revoke, release, shrink.

Under an MPI with fault tolerance (:mod:`~tensorplay_mpi.comm._fault_tolerance`), a survivor
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

from ._fault_tolerance import is_process_failure
from ._guard import Guard
from ._work import pending_of


def none_lost(comm: MPI.Intracomm) -> bool:
    """Whether no rank of `comm` is lost, the same answer on every survivor
    (``MPI_Comm_agree``: a fault-tolerant agreement, which a revoked communicator still runs).

    Collective over the survivors of `comm`.  Each survivor must agree once on a communicator
    before it shrinks it (:func:`shrink`), whichever path brought it there.
    """
    try:
        comm.Agree(1)
    except MPI.Exception as error:
        if is_process_failure(error):
            return False
        raise
    return True


def revoke(comm: MPI.Intracomm, grace: float) -> None:
    """Revoke `comm` and release the library's operations on it: each ends in error (its
    result void), so that nothing stays pending at exit; any left after `grace` s is dropped.
    Local (the revocation reaches the other ranks by itself)."""
    guard = Guard.of(comm)
    for each in [comm, *(guard.private() if guard is not None else [])]:
        each.Revoke()
    if guard is not None:
        guard.broken = guard.broken or "the loss of a rank (the communicator is revoked)"
        _release(guard, grace)


def shrink(comm: MPI.Intracomm, grace: float, agreed: bool = False
           ) -> tuple[MPI.Intracomm, list[int]]:
    """Revoke `comm`, release the library's operations on it, agree, and shrink it.

    Collective over the survivors of `comm`: each must call it (a survivor learns of the loss
    in its next operation on `comm`, which the revocation ends at once).  The agreement
    (:func:`none_lost`) comes first, so that a survivor that learnt of the loss from an agreement
    of its own (`agreed`: an elastic Join's end) meets the others there.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The communicator that lost ranks.
    grace : float
        Seconds to wait for the library's operations on it to end in error (:func:`revoke`).
    agreed : bool, default False
        This rank has run :func:`none_lost` on `comm` already (and it said a rank was lost).

    Returns
    -------
    (mpi4py.MPI.Intracomm, list of int)
        The survivors' communicator, and the lost ranks numbered in `comm` (the same on every
        survivor).
    """
    revoke(comm, grace)
    if not agreed:
        none_lost(comm)  # False: a rank is lost (this is why we are here)
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
