"""Going on without lost ranks (``Join(..., elastic=True)``): shrink, settle, move.

Under an MPI with fault tolerance (Open MPI 5 under ``mpiexec --with-ft ulfm``), a lost rank
surfaces in every survivor's next operation on the Join's communicator.  An elastic Join then,
on every survivor:

1. revokes the communicator and shrinks it to the survivors
   (:func:`~tensorplay_mpi.comm.shrink.shrink`);
2. settles the interrupted iteration: each survivor counts the updates it applied (the step
   owners': a DataParallel with ``update=``, the library's optimizers).  Survivors are at most
   one update apart (the interrupted one completed on some of them only); every survivor
   adopts the replicated state (parameters, buffers, optimizer state, counters) of the
   lowest-ranked survivor that applied the most.  The step is never half applied: it is
   complete on every survivor, or on none, and then each rank's batch of it is unused;
3. moves every joinable onto the survivors' communicator, and raises
   :class:`~tensorplay_mpi.errors.RanksLostError` saying what happened.

A joinable takes part when it sets ``_elastic = True`` and implements ``_elastic_progress()``
(updates applied, or ``None`` when it owns no step), ``_elastic_state()`` (the arrays a
survivor behind receives, its counters among them), ``_elastic_restore()`` (read its counters
back from those arrays) and ``_move_to(comm)``.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from mpi4py import MPI

from ..comm.buffers import copy_into
from ..comm.collectives import iallreduce, ibcast
from ..comm.fault_tolerance import fault_tolerance, is_process_failure
from ..comm.guard import Guard
from ..comm.shrink import agree, shrink
from ..errors import RanksLostError
from ..process import set_up
from ..settings import settings

__all__ = ["check_elastic", "progress", "recover", "settle"]


def check_elastic(joinables: Sequence[Any]) -> None:
    """Raise ``ValueError`` unless every joinable can go on without lost ranks and one owns the
    step (every rank alike: it depends on the kinds only)."""
    refused = [type(j).__name__ for j in joinables if not getattr(j, "_elastic", False)]
    if refused:
        raise ValueError(
            f"Join(elastic=True): {', '.join(refused)} cannot go on without a lost rank (its "
            "state would be lost with it: a ZeroRedundancyOptimizer's shards, a joinable of "
            "your own); leave elastic off and resume from periodic saves instead")
    if progress(joinables) is None and any(j._elastic_needs_owner for j in joinables):
        raise ValueError(
            "Join(elastic=True) needs the joinable that applies the step in the Join, to "
            "settle an interrupted step: DataParallel(..., update=...) or Join([dp, opt]) "
            "with one of the library's optimizers")


def progress(joinables: Sequence[Any]) -> int | None:
    """The updates applied on this rank: the highest count of the joinables that own a step."""
    counts = [c for c in (j._elastic_progress() for j in joinables) if c is not None]
    return max(counts) if counts else None


def recover(comm: MPI.Intracomm, joinables: Sequence[Any], error: BaseException | None,
            timeout: float | None = None, entered: int | None = None,
            agreed: bool = False) -> RanksLostError:
    """Go on without the ranks lost from `comm`: shrink, settle, move `joinables`.

    An elastic Join calls it; call it yourself for a loss that surfaces outside a Join (an
    MPI error on `comm` for which :func:`~tensorplay_mpi.comm.fault_tolerance.is_process_failure`
    is true, in a validation between Joins, say), with the joinables of your Joins.

    Collective over the survivors of `comm`: each calls it with the same joinables.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The communicator that lost ranks (the Join's).
    joinables : sequence of Joinable
        The Join's joinables (every one with ``_elastic``).
    error : BaseException or None
        MPI's report of the loss on this rank (None: :func:`~tensorplay_mpi.comm.shrink.agree`
        said so).
    timeout : float, optional
        The deadline of each wait on the survivors' communicator; default the library's.
    entered : int, optional
        :func:`progress` when the Join was entered; default now (``steps`` is then 0).
    agreed : bool, default False
        This rank has run :func:`~tensorplay_mpi.comm.shrink.agree` on `comm` already.

    A rank lost during the recovery itself (in the shrink, the settle) is lost the same way:
    the survivors shrink again, and every survivor agrees on each communicator before it adopts
    a state, so that all of them go on from the same one.

    Returns
    -------
    RanksLostError
        What to raise: the lost ranks, the survivors' communicator, the settled step.
    """
    check_elastic(joinables)
    timeout = settings().timeout if timeout is None else timeout
    mine = progress(joinables) or 0  # not None: check_elastic
    entered = mine if entered is None else entered
    old_rank, old_size = comm.Get_rank(), comm.Get_size()
    members, lost, current = list(range(old_size)), [], comm  # members: ranks of `comm`
    while True:
        survivors, gone = shrink(current, settings().grace, agreed)
        lost += [members[r] for r in gone]
        members = [m for i, m in enumerate(members) if i not in gone]
        try:
            set_up(survivors)
            Guard.attach(survivors)
            settled = settle(survivors, joinables, timeout)
        except MPI.Exception as again:  # a rank lost during the recovery
            if not is_process_failure(again, survivors):
                raise
            current, agreed = survivors, False
            continue
        if settled is not None:
            break
        current, agreed = survivors, True  # the settle's agreement said a rank was lost
    step, root = settled
    for joinable in joinables:
        joinable._move_to(survivors)
    completed = mine < step
    how = ("no step to settle" if progress(joinables) is None else
           f"from step {step}, completed on this rank by rank {root} of the survivors"
           if completed else f"from step {step} (an interrupted step not applied anywhere is "
           "redone)")
    return RanksLostError(
        f"rank {old_rank}: rank(s) {sorted(lost)} of {old_size} were lost "
        f"({error or 'agreed at the end of the Join'}); going on with "
        f"{survivors.Get_size()} ranks ({how}), as rank {survivors.Get_rank()}",
        lost=sorted(lost), comm=survivors, old_rank=old_rank, old_size=old_size, step=step,
        steps=step - entered, completed=completed)


def settle(comm: MPI.Intracomm, joinables: Sequence[Any], timeout: float
           ) -> tuple[int, int] | None:
    """Bring every rank of `comm` to the most updates any applied: every rank adopts the
    joinables' state of the lowest rank that applied them (the same where a rank is at that
    step already, unless a broadcast of the interrupted Join was half received); return that
    step and that rank.

    Collective over `comm`.  Under fault tolerance a rank adopts what it received only once
    every rank agreed that none was lost meanwhile (:func:`~tensorplay_mpi.comm.shrink.agree`);
    returns ``None``, having changed nothing, when one was.

    Raises
    ------
    RuntimeError
        On every rank, if ranks are more than one update apart.
    mpi4py.MPI.Exception
        When a rank is lost in the settle's collectives (nothing changed).
    """
    step, root = _agree_on_step(comm, progress(joinables) or 0, timeout)
    arrays = list({id(a): a for j in joinables for a in j._elastic_state()}.values())
    received = arrays if comm.Get_rank() == root else [a.copy() for a in arrays]  # scratch:
    works = [ibcast(comm, a, root, f"elastic settle: state {i + 1} of {len(received)}")
             for i, a in enumerate(received)]  # adopted once every rank has it
    for work in works:
        work.wait_or_abort(timeout)
    if fault_tolerance()[0] and not agree(comm):
        return None
    for array, value in zip(arrays, received):
        if value is not array:
            copy_into(array, value)
    for joinable in joinables:
        joinable._elastic_restore()
    return step, root


def _agree_on_step(comm: MPI.Intracomm, mine: int, timeout: float) -> tuple[int, int]:
    """The settled step (the most updates any survivor applied) and the survivor that sends
    its state: the lowest rank that applied them (one ``Iallreduce(int64[2], MAX)`` of
    ``[updates * size + size - 1 - rank, -updates]``)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    span = np.array([mine * size + size - 1 - rank, -mine], np.int64)
    iallreduce(comm, MPI.IN_PLACE, span, MPI.MAX, "elastic settle: steps").wait_or_abort(
        timeout)
    most, fewest = int(span[0]) // size, -int(span[1])
    if most - fewest > 1:
        raise RuntimeError(
            f"rank {comm.Get_rank()}: the survivors applied from {fewest} to {most} updates: "
            "more than the one an interrupted step explains, so no survivor's state is "
            "everyone's; end the job and resume from the last periodic save")
    return most, size - 1 - int(span[0]) % size
