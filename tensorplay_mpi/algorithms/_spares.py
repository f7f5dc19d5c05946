"""Hot spares: processes that wait, asleep, and take a lost training rank's place.

A job started with ``K`` spares trains on the other ranks (``SparePool(comm, spares=K)``):
the pool's communicator holds every process, the training communicator the trainers.  A
spare builds its joinables (and its Sampler) on a communicator of its own, as a trainer does
on the training one, then waits (:meth:`SparePool.wait`): a receive from the pool's first
rank (a trainer), tested every :data:`POLL_S` with a sleep in between, so that it does not
burn a core.  It ends in one of two ways:

- the job ends: the trainers' :meth:`SparePool.close` ends the wait, which returns
  ``False`` (under fault tolerance they revoke and shrink the pool as below, and gather the
  end; without it, the pool's first rank sends each spare a message);
- a trainer was lost (an elastic Join raised :class:`~tensorplay_mpi.errors.RanksLostError`
  on the survivors): the survivors' :meth:`SparePool.refill` revokes the pool's communicator
  (the revocation ends the spares' receives; a lost first rank of the pool ends them too),
  every live process of the pool agrees and shrinks it
  (:func:`~tensorplay_mpi.comm._shrink.shrink`; Open MPI's ``MPI_Comm_ishrink`` failed with
  ``MPI_ERR_INTERN`` here) and gathers who trains at which place.  The lowest-ranked spares
  take the lost ranks' places, the lowest place first; trainers and recruits split a
  training communicator off the pool, ranked by place, so the width is the width before the
  loss while spares are left.  Every joinable moves onto it, a recruit adopts the trainers'
  replicated state (the elastic settle's broadcast, rooted at a trainer), and every Sampler
  re-splits the epoch's unconsumed samples over the restored width
  (:meth:`~tensorplay_mpi.data.Sampler.admit`).  A recruit's wait returns ``True``.

A lost spare changes nothing for the trainers: they learn of it only at their next
:meth:`~SparePool.refill` or :meth:`~SparePool.close` (the pool's shrink leaves it out).  With
no spare left, :meth:`~SparePool.refill` returns the survivors' communicator, as an elastic
Join without spares goes on.  A process lost during a recruitment itself (in the pool's
gather, the split, the state's broadcast) is not recovered from: the job ends with an error.
"""

from __future__ import annotations

import atexit
import operator
import time
from typing import Any, Sequence, cast

import numpy as np
from mpi4py import MPI

from ..comm._collectives import iallgather, ibcast
from ..comm._fault_tolerance import fault_tolerance, is_process_failure
from ..comm._guard import Guard
from ..comm._shrink import shrink
from ..errors import RanksLostError
from .._process import set_up
from ..settings import settings
from ._elastic import check_elastic, settle

POLL_S = 0.01
"""How long a waiting spare sleeps between two tests of its receive (and a rank between two
tests of the pool's other requests): it costs no core, and answers within this much."""

_TAG = 7151  # the close message's tag (without fault tolerance), on the pool's own
_WAITING, _CLOSING = -1, -2  # a spare's place, and the trainers' at the end


class SparePool:
    """The processes of `comm`, trainers first, the last `spares` of them hot spares.

    Collective over `comm`: every process must make it.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        Every process of the job (``MPI.COMM_WORLD``); its first ``size - spares`` ranks train.
    spares : int
        How many processes wait to replace a lost trainer (0: none; every process trains).

    Attributes
    ----------
    comm : mpi4py.MPI.Intracomm
        A trainer's training communicator (the one to build the joinables on); a spare's
        communicator of its own until it is recruited, then the training one.
    spare : bool
        Whether this process is a spare that has not been recruited.
    spares : int
        The spares the trainers know of (a lost spare counts until the next recruitment).

    Examples
    --------
    ::

        pool = SparePool(MPI.COMM_WORLD, spares=1)
        comm = pool.comm
        sampler = Sampler(len(data), comm.rank, comm.size, batch_size=16)
        dp = DataParallel(params, comm=comm)
        opt = SGD(params, dp.grads, lr=0.1)
        if pool.spare and not pool.wait([dp, opt], sampler):
            sys.exit(0)                      # the job ended without needing this spare
        for epoch in range(sampler.epoch, epochs + 1):
            sampler.set_epoch(epoch)
            while True:
                try:
                    with Join([dp, opt], elastic=True):
                        for idx in sampler:
                            ...
                    break
                except RanksLostError as lost:
                    sampler.shrink(lost.lost, lost.steps)
                    comm = pool.refill(lost, [dp, opt], sampler)
        pool.close()                         # the spares left waiting exit
    """

    def __init__(self, comm: MPI.Intracomm, spares: int) -> None:
        size = comm.Get_size()
        if isinstance(spares, bool):
            raise TypeError(f"SparePool: spares must be an int, got {spares!r}")
        try:
            spares = operator.index(spares)  # NumPy integers too
        except TypeError:
            raise TypeError(f"SparePool: spares must be an int, got {spares!r}") from None
        if not 0 <= spares < size:
            raise ValueError(f"SparePool: spares must be in [0, {size}) (at least one process "
                             f"trains), got {spares!r}")
        set_up(comm)
        every = np.empty(size, np.int64)
        iallgather(comm, np.array([spares], np.int64), every,
                   "SparePool: the spares of every rank").wait_or_abort(settings().timeout)
        if every.min() != every.max():
            raise ValueError(f"SparePool: the ranks passed different spares "
                             f"({every.tolist()}); every process passes the same")
        self._pool = comm.Dup()  # the pool's own: its revocation touches no other
        rank = comm.Get_rank()
        self.spare = rank >= size - spares
        self._trainers = size - spares
        self._spare_ranks = list(range(self._trainers, size))  # in the pool
        self.spares = spares
        self.comm = cast(MPI.Intracomm, self._pool.Split(
            self._trainers + rank if self.spare else 0, rank))  # a spare's own, alone
        self._closed = False
        if spares and not self.spare:  # a trainer that never called close(): at exit, so
            atexit.register(_close_at_exit, self)  # that no spare keeps the job alive
    # -- a spare -----------------------------------------------------------------------------

    def wait(self, joinables: Sequence[Any], sampler: Any = None) -> bool:
        """Wait, asleep, until the job ends (``False``) or this spare replaces a lost trainer
        (``True``: its `joinables` work on the training communicator, :attr:`comm`, with the
        trainers' replicated state, and `sampler` gives this rank's share of the epoch's
        unconsumed samples).  A spare only; the joinables and the sampler made as a trainer
        makes its own, on :attr:`comm`.

        Raises
        ------
        RuntimeError
            If this process is not a waiting spare.
        """
        if not self.spare:
            raise RuntimeError("SparePool.wait: this process trains (it is no spare, or was "
                               "recruited already)")
        _refuse_sharded(joinables)
        if getattr(sampler, "weights", None) is not None:
            raise ValueError("SparePool.wait: a Sampler that splits by weights cannot take a "
                             "recruit (its share is unknown); split by skew with spares")
        if joinables:
            check_elastic(joinables)
        while self.spare and not self._closed:
            message = np.zeros(1, np.int64)
            request = self._pool.Irecv(message, source=0, tag=_TAG)
            try:
                while not request.Test():
                    time.sleep(POLL_S)
            except MPI.Exception as error:  # the pool was revoked, or its first rank lost
                if not is_process_failure(error):
                    raise
                self._recruit(None, joinables, sampler)
                continue
            self._closed = True  # the close message (without fault tolerance)
        return not self.spare

    # -- the trainers ------------------------------------------------------------------------

    def refill(self, lost: RanksLostError, joinables: Sequence[Any],
               sampler: Any = None) -> MPI.Intracomm:
        """After `lost` (an elastic Join's, or :func:`~tensorplay_mpi.algorithms.recover`'s),
        bring spares in at the lost ranks' places: the training communicator of the width
        before the loss (narrower when spares ran out); the `joinables` (moved onto
        ``lost.comm`` already) move onto it and `sampler` re-splits (call
        ``sampler.shrink(lost.lost, lost.steps)`` first).  Returns the new training
        communicator (also :attr:`comm`); ``lost.comm`` when no spare is left.

        Collective over the survivors of the training communicator and every live spare.
        A process lost during the recruitment itself ends the job with an MPI error.
        """
        if self.spare:
            raise RuntimeError("SparePool.refill: this process is a spare (wait() instead)")
        _refuse_sharded(joinables)
        if not isinstance(lost, RanksLostError):
            raise TypeError(f"SparePool.refill takes the RanksLostError of the loss, got "
                            f"{type(lost).__name__}")
        self.comm = lost.comm
        if self.spares:
            self._recruit(lost, joinables, sampler)
        return self.comm

    def close(self) -> None:
        """End the job's spares that were never recruited: each one's :meth:`wait` returns
        ``False``.  Every trainer calls it once, after training (a trainer that did not calls
        it at exit); a spare's call does nothing, and so does a second one.  Under fault
        tolerance the pool is revoked and shrunk as for a recruitment (a lost spare, or a lost
        first rank of the pool, is left out), else the pool's first rank sends each spare a
        message.

        Collective over the trainers and every live spare.
        """
        if self._closed or self.spare:
            return
        self._closed = True
        if not self.spares:
            return
        if fault_tolerance()[0]:
            self._recruit(None, (), None, closing=True)
            return
        if self._pool.Get_rank() != 0:
            return
        message = np.ones(1, np.int64)
        for rank in self._spare_ranks:
            try:
                self._pool.Isend(message, rank, _TAG).Wait()
            except MPI.Exception as error:  # a lost spare
                if not is_process_failure(error):
                    raise

    # -- both: the recruitment ---------------------------------------------------------------

    def _recruit(self, lost: RanksLostError | None, joinables: Sequence[Any],
                 sampler: Any, closing: bool = False) -> None:
        """Revoke and shrink the pool, gather each process's place (a trainer's: its rank
        before the loss, and that width; a spare: none; a trainer `closing`: the end), and
        bring the lowest spares in at the free places, or end the spares (collective over
        every live process of the pool)."""
        if not fault_tolerance()[0]:
            raise RuntimeError("SparePool: a spare can only be recruited under an MPI with "
                               "fault tolerance (Open MPI 5 under mpiexec --with-ft ulfm)")
        pool, _ = shrink(self._pool, settings().grace)  # Open MPI's Ishrink: MPI_ERR_INTERN
        self._pool = pool
        held_before = [_CLOSING, 0] if closing else [_WAITING, 0] if lost is None else [
            lost.old_rank, lost.old_size]
        mine = np.array([*held_before, int(sampler is not None)], np.int64)
        rows = np.empty((pool.Get_size(), 3), np.int64)
        self._wait(pool.Iallgather(mine, rows), "the pool's places")
        if (rows[:, 0] == _CLOSING).any():
            self._closed = True  # the end
            return
        if not (rows[:, 0] >= 0).any():
            self._closed = True
            raise RuntimeError("SparePool: every trainer was lost, and the training state with "
                               "them; end the job and resume from the last periodic save")
        if rows[:, 2].min() != rows[:, 2].max():
            raise ValueError("SparePool: some processes passed a sampler to wait()/refill() "
                             "and others none; pass the same on every process")
        held = {int(place): i for i, place in enumerate(rows[:, 0]) if place >= 0}
        width = int(rows[:, 1].max())
        free = [p for p in range(width) if p not in held]
        waiting = [i for i, place in enumerate(rows[:, 0]) if place < 0]
        places = {**held, **dict(zip(free, waiting))}  # place -> rank in the pool
        recruits = [i for i in waiting if i in places.values()]
        self._spare_ranks = [i for i in waiting if i not in recruits]
        self.spares = len(self._spare_ranks)
        rank = pool.Get_rank()
        if not recruits:
            return  # the trainers go on with lost.comm
        place = next((p for p, i in places.items() if i == rank), None)
        comm = cast(MPI.Intracomm, pool.Split(MPI.UNDEFINED if place is None else 0,
                                              0 if place is None else place))
        if place is None:
            return  # a spare left waiting
        self.comm, self.spare = comm, False
        order = sorted(places)  # the training ranks, by place
        root = min(order.index(p) for p in held)  # a trainer: every one holds the state
        _admit(comm, joinables, sampler, root)

    def _wait(self, request: MPI.Request, what: str) -> None:
        """Test `request` until it completes, asleep between tests, within the deadline."""
        deadline = time.monotonic() + settings().timeout
        while not request.Test():
            if time.monotonic() > deadline:
                raise RuntimeError(f"SparePool: {what} did not complete within "
                                   f"{settings().timeout} s")
            time.sleep(POLL_S / 10)


def _close_at_exit(pool: SparePool) -> None:
    """A trainer's :meth:`SparePool.close` at exit, where the program did not call it: the
    spares still waiting must not keep the job alive."""
    if not pool._closed and not MPI.Is_finalized():
        pool.close()


def _refuse_sharded(joinables: Sequence[Any]) -> None:
    """``ValueError`` for a joinable whose state is sharded (a ZeroRedundancyOptimizer): a
    recruit holds no shard and no copy of one, so it could not take a lost rank's place."""
    sharded = [type(j).__name__ for j in joinables if getattr(j, "sharded", False)]
    if sharded:
        raise ValueError(f"SparePool: a recruited spare cannot take a lost rank's place in a "
                         f"{sharded[0]} (it holds no shard and no copy of one); train a "
                         "sharded optimizer without spares (an elastic Join with copies=True "
                         "goes on narrower)")


def _admit(comm: MPI.Intracomm, joinables: Sequence[Any], sampler: Any, root: int) -> None:
    """Move `joinables` onto `comm`, give every rank the state of `root`'s, and re-split
    `sampler` over `comm` (collective over `comm`)."""
    set_up(comm)
    Guard.attach(comm)
    for joinable in joinables:
        joinable.move_to(comm)
    timeout = settings().timeout
    if joinables and settle(comm, joinables, timeout, root=root) is None:
        raise RuntimeError(f"rank {comm.Get_rank()}: a process was lost while a spare was "
                           "brought in")
    if sampler is None:
        return
    state = sampler.state() if comm.Get_rank() == root else np.empty(0, np.int64)
    length = np.array([state.size], np.int64)
    ibcast(comm, length, root, "spares: the sampler's state size").wait_or_abort(timeout)
    if comm.Get_rank() != root:
        state = np.empty(int(length[0]), np.int64)
    ibcast(comm, state, root, "spares: the sampler's state").wait_or_abort(timeout)
    sampler.admit(comm.Get_rank(), comm.Get_size(), state)
