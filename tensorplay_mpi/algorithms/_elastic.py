"""Going on without lost ranks (``Join(..., elastic=True)``): shrink, settle, move.

Under an MPI with fault tolerance (Open MPI 5 under ``mpiexec --with-ft ulfm``), a lost rank
surfaces in every survivor's next operation on the Join's communicator.  An elastic Join then,
on every survivor:

1. revokes the communicator and shrinks it to the survivors
   (:func:`~tensorplay_mpi.comm._shrink.shrink`);
2. settles the interrupted iteration: each survivor counts the updates it applied (the step
   owners': a DataParallel with ``update=``, the library's optimizers).  Survivors are at most
   one update apart (the interrupted one completed on some of them only); every survivor
   adopts the replicated state (parameters, buffers, optimizer state, counters) of the
   lowest-ranked survivor that applied the most.  The step is never half applied: it is
   complete on every survivor, or on none, and then each rank's batch of it is unused;
3. moves every joinable onto the survivors' communicator, and raises
   :class:`~tensorplay_mpi.errors.RanksLostError` saying what happened.

A joinable takes part when it is an :class:`~tensorplay_mpi.algorithms.ElasticJoinable`:
``elastic_progress()`` (updates applied, or ``None`` when it owns no step),
``elastic_state()`` (the arrays a survivor behind receives, its counters among them),
``elastic_restore()`` (read its counters back from those arrays), ``move_to(comm)`` and
``elastic_companions()``: the objects outside the Join whose state its steps advance (a
DataParallel's ``update=`` optimizer, :func:`update_owner`), settled with it: their
``state_dict()``, pickled on the survivor whose state every survivor adopts, is loaded
(``load_state_dict()``) on the others.

The buffers (BatchNorm's running statistics) an interrupted step's forward pass moved are not
the state of any completed step: a DataParallel keeps a copy of them as its last completed
step left them (:class:`BufferSnapshot`), and the settle sends and restores that copy.
"""

from __future__ import annotations

import pickle
import types
import weakref
from typing import Any, Callable, Sequence

import numpy as np
from mpi4py import MPI

from ..comm import _torch_cuda as torch_cuda
from ..comm._buffers import copy_into
from ..comm._agreement import agree, same_everywhere
from ..comm._collectives import iallgather, iallreduce, ibcast
from ..comm._digests import layout_digest
from ..comm._fault_tolerance import fault_tolerance, is_process_failure
from ..comm._guard import Guard
from ..comm._shrink import none_lost, shrink
from ..errors import RanksLostError
from .._process import set_up
from ..settings import settings
from ._joinable import ElasticJoinable, Joinable

_STATE_METHODS = ("state_dict", "load_state_dict")  # what update='s owner needs (settled)


def check_elastic(joinables: Sequence[Any]) -> None:
    """Raise ``ValueError`` unless every joinable can go on without lost ranks and one owns the
    step (every rank alike: it depends on the kinds only)."""
    refused = [type(j).__name__ for j in joinables if not isinstance(j, ElasticJoinable)]
    if refused:
        raise ValueError(
            f"Join(elastic=True): {', '.join(refused)} cannot go on without a lost rank (its "
            "state would be lost with it: a joinable of your own that is not an "
            "ElasticJoinable); leave elastic off and resume from periodic saves instead")
    owners = [type(j).__name__ for j in joinables if j.elastic_progress() is not None]
    if len(owners) > 1:
        raise ValueError(
            f"Join(elastic=True): {' and '.join(owners)} both count the updates they apply; "
            "the settle needs one count of steps, so one joinable owns the step (a "
            "JoinableComm that keeps arrays in a Join of its own, say)")
    companions(joinables)  # a DataParallel's update= that cannot be settled raises here
    steps = [j for j in joinables if j.elastic_progress() is not None
             and not getattr(j, "_counts_own_results", False)]  # a JoinableComm's kept
    if not steps and any(j.needs_step_owner for j in joinables):  # results are no step
        raise ValueError(
            "Join(elastic=True) needs the joinable that applies the step in the Join, to "
            "settle an interrupted step: DataParallel(..., update=...) or Join([dp, opt]) "
            "with one of the library's optimizers (a JoinableComm's kept arrays count its "
            "own results, not the DataParallel's steps)")


def update_owner(update: Callable[[], Any]) -> Any:
    """The object whose state a DataParallel's ``update=`` advances, settled with it in an
    elastic Join: the object `update` is a bound method of (``opt.step``), when it has
    ``state_dict()`` and ``load_state_dict()``.

    Raises
    ------
    ValueError
        For any other callable (a function, a lambda: what it advances cannot be seen), or the
        method of an object whose state cannot go on without a lost rank (a
        ZeroRedundancyOptimizer).
    """
    owner = getattr(update, "__self__", None) or _scheduler_wrapped(update)
    name = getattr(update, "__qualname__", type(update).__name__)
    if owner is None or isinstance(owner, types.ModuleType) or not all(
            callable(getattr(owner, method, None)) for method in _STATE_METHODS):
        raise ValueError(
            f"Join(elastic=True): DataParallel's update= is {name}, not a bound method of an "
            "object with state_dict() and load_state_dict(); an elastic Join settles an "
            "interrupted step with the state of the object whose method update= is, and it "
            "cannot see what another callable advances. Pass update=opt.step (a torch "
            "optimizer) or, to clip and step a scheduler too, the step() of an object of your "
            "own whose state_dict() holds the optimizer's and the scheduler's "
            "(docs/elastic.md); with one of this library's optimizers bound to dp.grads, use "
            "Join([dp, opt]) instead of update=")
    if isinstance(owner, Joinable) and (not isinstance(owner, ElasticJoinable)
                                        or getattr(owner, "sharded", False)):
        raise ValueError(
            f"Join(elastic=True): DataParallel's update= steps {type(owner).__name__}, which "
            "cannot be settled as update= (a ZeroRedundancyOptimizer's shards: put it in "
            "the Join, Join([dp, zero], elastic=True), constructed with copies=True)")
    return owner


def _scheduler_wrapped(update: Callable[[], Any]) -> Any:
    """The torch optimizer whose ``step`` an LR scheduler replaced with a wrapper (``opt.step``
    is then a function holding a weak reference to the optimizer), else ``None``."""
    if not getattr(update, "_wrapped_by_lr_sched", False):
        return None
    for cell in getattr(update, "__closure__", None) or ():
        contents = cell.cell_contents
        if isinstance(contents, weakref.ref):
            return contents()
    return None


def companions(joinables: Sequence[Any]) -> list[Any]:
    """The objects outside the Join whose state the steps of `joinables` advance (each
    joinable's ``elastic_companions()``: a DataParallel's ``update=`` optimizer), once each;
    raises what :func:`update_owner` raises."""
    found = [owner for j in joinables
             for owner in j.elastic_companions()]
    return list({id(owner): owner for owner in found}.values())


class BufferSnapshot:
    """A copy of `buffers` (running statistics) as the last completed step left them.

    The forward pass of a step that no survivor completes has moved the buffers already (a
    BatchNorm's running mean, its ``num_batches_tracked``) on every rank that ran it; the step
    is redone, so an elastic settle sends and restores this copy instead.  A DataParallel
    keeps it when an elastic Join is made and at the end of each step it completes in one
    (a copy of the buffers: small next to the parameters).
    """

    def __init__(self, buffers: Sequence[Any]) -> None:
        self._buffers = list(buffers)
        self._kept: list[Any] | None = None

    def keep(self) -> None:
        """Copy the buffers as they are now."""
        if not self._buffers:
            return
        torch_cuda.take()  # torch CUDA buffers: read after torch's writes, and torch's next
        if self._kept is None:  # writes after the copy
            self._kept = [buffer.copy() for buffer in self._buffers]
        else:
            for kept, buffer in zip(self._kept, self._buffers):
                copy_into(kept, buffer)
        torch_cuda.hand_back()

    def arrays(self) -> list[Any]:
        """What a settle sends and receives: the copy, or the buffers before the first."""
        return self._buffers if self._kept is None else self._kept

    def restore(self) -> None:
        """Make the buffers the copy (after a settle wrote into it)."""
        if self._kept is None:
            return
        torch_cuda.take()
        for buffer, kept in zip(self._buffers, self._kept):
            copy_into(buffer, kept)
        torch_cuda.hand_back()


def progress(joinables: Sequence[Any]) -> int | None:
    """The updates applied on this rank: the highest count of the joinables that own a step."""
    counts = [c for c in (j.elastic_progress() for j in joinables) if c is not None]
    return max(counts) if counts else None


def recover(comm: MPI.Intracomm, joinables: Sequence[Any], error: BaseException | None,
            timeout: float | None = None, entered: int | None = None,
            agreed: bool = False) -> RanksLostError:
    """Go on without the ranks lost from `comm`: shrink, settle, move `joinables`.

    An elastic Join calls it; call it yourself for a loss that surfaces outside a Join (an
    MPI error on `comm` for which :func:`~tensorplay_mpi.comm.is_process_failure`
    is true, in a validation between Joins, say), with the joinables of your Joins.

    Collective over the survivors of `comm`: each calls it with the same joinables.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The communicator that lost ranks (the Join's).
    joinables : sequence of Joinable
        The Join's joinables (every one an ElasticJoinable).
    error : BaseException or None
        MPI's report of the loss on this rank (None:
        :func:`~tensorplay_mpi.comm._shrink.none_lost` said so).
    timeout : float, optional
        The deadline of each wait on the survivors' communicator; default the library's.
    entered : int, optional
        :func:`progress` when the Join was entered; default now (``steps`` is then 0).
    agreed : bool, default False
        This rank has run :func:`~tensorplay_mpi.comm._shrink.none_lost` on `comm` already.

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
        joinable.move_to(survivors)
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


def settle(comm: MPI.Intracomm, joinables: Sequence[Any], timeout: float,
           root: int | None = None) -> tuple[int, int] | None:
    """Bring every rank of `comm` to the most updates any applied: every rank adopts the
    joinables' state of the lowest rank that applied them (the same where a rank is at that
    step already, unless a broadcast of the interrupted Join was half received); return that
    step and that rank.  The companions of the joinables (:func:`companions`) are settled with
    them.  A `root` given (a recruited spare's joinables: :mod:`._spares`) is the rank whose
    state every rank adopts, however many updates it applied.

    Collective over `comm`.  Under fault tolerance a rank adopts what it received only once
    every rank agreed that none was lost meanwhile (:func:`~tensorplay_mpi.comm._shrink.none_lost`);
    returns ``None``, having changed nothing, when one was.

    Raises
    ------
    RuntimeError
        On every rank, if ranks are more than one update apart.
    mpi4py.MPI.Exception
        When a rank is lost in the settle's collectives (nothing changed).
    """
    step = None  # with `root` given: that rank's, once adopted
    if root is None:
        step, root = _settled_step(comm, progress(joinables) or 0, timeout)
        for joinable in joinables:  # sharded state (a ZeRO's, from its copies) first
            if hasattr(joinable, "_elastic_reshard"):
                joinable._elastic_reshard(comm, step, root, timeout)
    owners = companions(joinables)
    states = [j.elastic_state() for j in joinables]  # once: it writes the counters' arrays
    arrays = list({id(a): a for state in states for a in state}.values())
    layout = [(type(j).__name__, [(np.shape(a), np.dtype(a.dtype).str) for a in state])
              for j, state in zip(joinables, states)]
    if not same_everywhere(lambda pair: iallreduce(comm, MPI.IN_PLACE, pair, MPI.MAX,
                                                    "elastic settle: layouts"),
                           layout_digest(layout), timeout):
        raise ValueError(
            f"rank {comm.Get_rank()}: the survivors' elastic_state() arrays differ in number, "
            f"shape or dtype (this rank's: {layout}); an ElasticJoinable's state must be laid "
            "out alike on every rank, so that a survivor behind can receive another's")
    received = arrays if comm.Get_rank() == root else [a.copy() for a in arrays]  # scratch:
    works = [ibcast(comm, a, root, f"elastic settle: state {i + 1} of {len(received)}")
             for i, a in enumerate(received)]  # adopted once every rank has it
    for work in works:
        work.wait_or_abort(timeout)
    state_dicts = _broadcast_state_dicts(comm, owners, root, timeout) if owners else []
    if fault_tolerance()[0] and not none_lost(comm):
        return None
    for array, value in zip(arrays, received):
        if value is not array:
            copy_into(array, value)
    for joinable in joinables:
        joinable.elastic_restore()
    failure = None
    if comm.Get_rank() != root:
        try:
            for owner, state_dict in zip(owners, state_dicts):
                owner.load_state_dict(state_dict)
        except Exception as error:  # every survivor learns it: replicas would differ
            failure = error
    if owners:
        agree(lambda row, every: iallgather(comm, row, every, "elastic settle: loads"),
                 comm.Get_rank(), comm.Get_size(), "the elastic settle's load_state_dict() of "
                 "update='s owner", timeout, failure)
    return (progress(joinables) or 0) if step is None else step, root


def _broadcast_state_dicts(comm: MPI.Intracomm, owners: Sequence[Any], root: int,
                           timeout: float) -> list[Any]:
    """The ``state_dict()`` of each of `owners` on `root`, on every rank (pickled: its length,
    then its bytes, two ``Ibcast``).  A state that `root` cannot pickle travels as the length
    -1: every rank raises (`root` its own error, the others ``RuntimeError`` naming it)."""
    mine = comm.Get_rank() == root
    payload, failure = bytearray(), None
    if mine:
        try:
            payload = bytearray(pickle.dumps([o.state_dict() for o in owners]))
        except Exception as error:
            failure = error
    length = np.array([-1 if failure is not None else len(payload)], np.int64)
    ibcast(comm, length, root, "elastic settle: state dicts' size").wait_or_abort(timeout)
    if failure is not None:
        raise failure
    if length[0] < 0:
        raise RuntimeError(f"rank {comm.Get_rank()}: the elastic settle could not send the "
                           f"state_dict() of update='s owner: it failed on rank {root}, the "
                           "survivor whose state every survivor adopts")
    data = np.frombuffer(payload, np.uint8) if mine else np.empty(int(length[0]), np.uint8)
    ibcast(comm, data, root, "elastic settle: state dicts").wait_or_abort(timeout)
    return [] if mine else pickle.loads(data.tobytes())


def _settled_step(comm: MPI.Intracomm, mine: int, timeout: float) -> tuple[int, int]:
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
