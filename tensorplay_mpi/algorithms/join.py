"""Join, Joinable and JoinHook over MPI: the uneven-inputs protocol and nothing else.

The contract is the one of ``torch.distributed.algorithms.join``.  The wire protocol (all int64,
all nonblocking; the documentation's "Wire protocol" page has every joinable's schedule):

- active rank, each iteration: every joinable's :meth:`Joinable.end_iteration` (list order),
  then ``Iallreduce([1], SUM)`` (the heartbeat), then the iteration's collectives, joinable by
  joinable in list order.  The heartbeat's higher bits carry stop and save requests
  (:mod:`tensorplay_mpi.algorithms._requests` reads them; the Join runs ``on_save``);
- on leaving the block: every ``end_iteration`` once more, then the joined loop.  Joined rank,
  each round: ``Iallreduce([0], SUM)`` (plus the request bits) + wait gives the
  number of active ranks ``n`` (the low field); ``n == 0`` ends the loop, else every main hook
  shadows one active iteration, in list order; then every post hook once, in list order;
- a save request read in a heartbeat or poll makes every rank run the Join's ``on_save`` once,
  at one boundary: an active rank before its next heartbeat (after ``end_iteration``) or, when
  it leaves the block, before its first poll; a joined rank after that round's main hooks (after
  the post hooks when the poll said ``n == 0``); never once the Join has stopped;
- with a stream (:mod:`tensorplay_mpi.algorithms._stream`: a joinable with ``_orders_blocks``,
  the JoinableComm), while ranks have joined: the joinables that announce their blocks
  (``_announces_blocks``) announce each one through it (:meth:`Join.announce`), and a joined
  rank runs their hooks where the stream names them, in the order the active ranks issued
  them, instead of in list order;
- throw mode adds one pair per iteration: active ``Iallreduce([0])`` + wait (raise if > 0),
  joined ``Iallreduce([1])`` + wait, then raise
  :class:`~tensorplay_mpi.errors.EarlyTerminationError`.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterable, Iterator

import numpy as np
from mpi4py import MPI

from ..comm._buffers import check_device
from ..comm._collectives import Work, check_comm, iallreduce, resolve_timeout
from ..errors import EarlyTerminationError
from .._process import set_up
from ._joinable import ElasticJoinable, Joinable, JoinHook, _bound_join, _check_not_forgotten
from ._recovery import Recovery
from ._requests import Requests
from ._stream import BlockOrderer, BlockStream

__all__ = ["Join", "Joinable", "JoinHook", "ElasticJoinable"]

for _contract in (Joinable, JoinHook, ElasticJoinable):  # their public home, as torch's
    _contract.__module__ = __name__

SKEW_WARN_ROUNDS = 1000
"""A joined rank that shadows more rounds than this warns once about the input skew."""

JOIN_CHECK = "_tensorplay_join_check"
"""The attribute a layer sets on its parameters and buffers (SyncBatchNorm: a callable taking a
Join, with a ``needs_stream`` attribute, true while the layer has no group) that a joinable over
them (DataParallel) reads: it holds a JoinableComm for the layers that need one, and calls the
check when a Join is made with it, a check between joinables that the Join itself does not run
(not API: the library's layers set and read it)."""

_running: list["Join"] = []  # the entered, enabled Joins of this process, innermost last
_saving: list["Join"] = []  # the Joins whose on_save runs now

class Join:
    """Context manager that lets ranks with fewer inputs shadow ranks that still have inputs.

    Inside the block each rank iterates over its own inputs; each iteration of a joinable
    starts with ``Join.notify_join_context(joinable)``.  A rank that leaves the block keeps
    running its joinables' main hooks, one round per iteration of the ranks still active, until
    every rank has left; then every post hook runs once.

    Collective over the joinables' communicator: every rank must enter and leave the block.

    Parameters
    ----------
    joinables : list of Joinable
        At least one, all distinct and on the same communicator.  The first one sends the
        heartbeat; hooks run in list order.  A joinable may bring joinables of its own, which
        follow the listed ones: a DataParallel over SyncBatchNorm layers converted without a
        group brings the JoinableComm their statistics go through (``Join([dp])`` holds
        ``dp``, then it).
    enable : bool, default True
        ``False`` makes the context inert (no heartbeat, no hooks), for even inputs.
    throw_on_early_termination : bool, default False
        Raise :class:`~tensorplay_mpi.errors.EarlyTerminationError` (a ``RuntimeError``) on
        every rank as soon as one rank runs out of inputs, instead
        of shadowing.
    timeout : float, optional
        Seconds any of the Join's waits may take before the job is aborted with
        :class:`~tensorplay_mpi.errors.CollectiveTimeoutError`; default
        ``$TENSORPLAY_MPI_TIMEOUT`` or 1800.
    on_save : callable, optional
        Called without arguments on every rank, joined or not, at one iteration boundary after
        a save request (:func:`~tensorplay_mpi.request_save`) of any rank rode a heartbeat or
        poll: the place for a periodic :func:`tensorplay_mpi.checkpoint.save`.  Without it a
        request only sets :attr:`save_due`.
    elastic : bool, default False
        Go on without ranks that are lost (killed, out of memory, their node gone) under an MPI
        with fault tolerance (Open MPI 5 under ``mpiexec --with-ft ulfm``): every survivor
        revokes and shrinks the communicator, settles the interrupted step (it is applied on
        every survivor or on none), moves every joinable onto the survivors' communicator and
        raises :class:`~tensorplay_mpi.errors.RanksLostError`; catch it and make a new Join.
        Every joinable must support it (DataParallel, SGD, Adam, AdamW, JoinableComm) and
        one must apply the step (``DataParallel(update=...)`` or ``Join([dp, opt])``).
        Without fault tolerance a lost rank ends the job, as without `elastic`.
    **kwargs
        Passed to every joinable's :meth:`Joinable.join_hook`.

    Raises
    ------
    ValueError
        If `joinables` is empty, holds a joinable twice, or spans several communicators;
        with `elastic`, if a joinable cannot go on without a lost rank or none applies the
        step.
    TypeError
        If an element is not a Joinable, skipped ``Joinable.__init__``, its communicator
        is not an intra-communicator, `on_save` is not callable or `elastic` not a bool.

    Notes
    -----
    Hooks are built here, in ``__init__``.  The Join is single-use; it is entered once.  The
    joinables are bound to it from ``__enter__`` until ``__exit__`` returns, so
    ``notify_join_context`` outside the block returns ``None``.  An exception inside the
    block propagates unchanged and no hook runs; the other ranks learn of it inside their
    next library wait and raise :class:`~tensorplay_mpi.errors.PeerFailureError` (see
    :mod:`tensorplay_mpi.comm._guard`).

    A stop request on any rank (a signal under :func:`~tensorplay_mpi.stop_on_signals`, or
    :func:`~tensorplay_mpi.request_stop`) rides in the next heartbeat: :attr:`stopped`
    becomes true on every rank at the same iteration.  A loop that checks it at the top of
    each iteration leaves the block on every rank at one iteration boundary, as ranks leave
    when their inputs run out::

        with stop_on_signals():
            with Join([dp, opt]) as join:
                for batch in my_batches:
                    if join.stopped:
                        break
                    ...
            if join.stopped:
                save_checkpoint(...)

    Examples
    --------
    A complete uneven-inputs program (``mpiexec -n 3 python -m mpi4py example.py``): rank
    ``r`` has ``3 + r`` inputs and each input is summed over all ranks::

        import numpy as np
        from mpi4py import MPI
        from tensorplay_mpi import Join, Joinable, JoinHook
        from tensorplay_mpi.comm import iallreduce

        class Summer(Joinable):
            def __init__(self, comm):
                super().__init__()
                self.comm, self.total = comm, 0.0

            def step(self, x):
                Join.notify_join_context(self)   # heartbeat: "I still have inputs"
                self.reduce(x)

            def reduce(self, x):
                out = np.empty_like(x)
                iallreduce(self.comm, x, out).wait()
                self.total += out.sum()

            def join_hook(self, **kwargs):
                return ShadowSum(self)

            @property
            def join_device(self):
                return "cpu"

            @property
            def join_process_group(self):
                return self.comm

        class ShadowSum(JoinHook):
            def __init__(self, summer):
                self.summer = summer

            def main_hook(self):                 # same collective, zero contribution
                self.summer.reduce(np.zeros(1))

        comm = MPI.COMM_WORLD
        summer = Summer(comm)
        with Join([summer]):
            for _ in range(3 + comm.rank):
                summer.step(np.ones(1))
        size = comm.size
        assert summer.total == 3 * size + size * (size - 1) // 2   # every input counted once
    """

    def __init__(
        self,
        joinables: Iterable[Joinable],
        enable: bool = True,
        throw_on_early_termination: bool = False,
        timeout: float | None = None,
        on_save: Callable[[], Any] | None = None,
        elastic: bool = False,
        **kwargs: Any,
    ) -> None:
        self._joinables = list(joinables)
        self._check_joinables()
        listed = list(self._joinables)
        brought = [other for joinable in listed for other in joinable._brought_joinables(listed)]
        if brought:
            self._joinables += brought
            self._check_joinables()
        if not isinstance(elastic, bool):
            raise TypeError(f"elastic must be True or False, got {elastic!r}")
        if on_save is not None and not callable(on_save):
            raise TypeError(f"on_save must be a callable or None, got {type(on_save).__name__}")
        self._comm: MPI.Intracomm = self._joinables[0].join_process_group
        self._rank = self._comm.Get_rank()
        for joinable in self._joinables:
            check_device(joinable.join_device, f"{type(joinable).__name__}.join_device")
        self._enable = bool(enable)
        self._throw_on_early_termination = bool(throw_on_early_termination)
        self._timeout = resolve_timeout(timeout)
        self._recovery = Recovery(self._comm, self._joinables, elastic, self._timeout)
        self._join_hooks = [joinable.join_hook(**kwargs) for joinable in self._joinables]
        orderers = [j for j in self._joinables
                    if j._orders_blocks and isinstance(j, BlockOrderer)]
        self._stream = BlockStream(orderers[0], self._joinables, self._join_hooks,
                                   self._rank) if orderers else None
        self._round_hooks = [  # a joined rank's round, in list order; announced blocks aside
            hook for joinable, hook in zip(self._joinables, self._join_hooks)
            if self._stream is None or not self._stream.follows(joinable)]
        self._heartbeats: list[Work] = []  # started heartbeats, owned until they complete
        self._count = np.zeros(1, dtype=np.int64)  # the one buffer of every poll/throw pair
        self._iterations = 0  # heartbeats sent
        self._requests = Requests(self._deferring)
        self._on_save = on_save
        self._saves = 0  # times on_save ran
        self._rounds = 0  # rounds shadowed once joined
        self._entered = False
        self._joining = False
        self._everywhere_depth = 0  # depth of code every rank runs at one point (on_save)
        marks = [joinable._made_join for joinable in self._joinables]
        try:
            for joinable in self._joinables:
                joinable._made_into(self)
        except BaseException:  # a joinable refused this Join: none of them was made into it
            for joinable, mark in zip(self._joinables, marks):
                joinable._made_join = mark
            raise

    def _check_joinables(self) -> None:
        if not self._joinables:
            raise ValueError("Join needs at least one joinable, got an empty list")
        for joinable in self._joinables:
            if not isinstance(joinable, Joinable):
                raise TypeError(f"Join takes Joinable objects, got {type(joinable).__name__}")
            _bound_join(joinable)
        if len({id(j) for j in self._joinables}) != len(self._joinables):
            names = [type(j).__name__ for j in self._joinables]
            raise ValueError(f"Join got the same joinable more than once: {names}")
        comm = check_comm(self._joinables[0].join_process_group, "join_process_group")
        for joinable in self._joinables[1:]:
            if check_comm(joinable.join_process_group, "join_process_group") != comm:
                raise ValueError(
                    "Join needs every joinable on the same communicator; "
                    f"{type(joinable).__name__}.join_process_group differs from the first "
                    f"joinable's ({type(self._joinables[0]).__name__})"
                )

    def __enter__(self) -> "Join":
        if self._entered:
            raise RuntimeError("this Join was already entered; a Join is single-use, "
                               "make a new one")
        for joinable in self._joinables:
            if _bound_join(joinable) is not None:
                raise RuntimeError(
                    f"{type(joinable).__name__} is already in an active Join; "
                    "two Joins cannot share a joinable"
                )
        self._entered = True
        set_up(self._comm)  # a bad environment value raises here, before anything starts
        self._recovery.enter(self._enable)
        for joinable in self._joinables:
            joinable._set_join_context(self)
        if self._enable:
            _running.append(self)
        return self

    @staticmethod
    def current() -> "Join | None":
        """The innermost entered, enabled Join of this process, unless its ``on_save`` runs
        now (every rank is then at one point of it), else ``None``: where a collective of the
        caller's (a checkpoint, a plain SyncBatchNorm) would cross-match a joined rank's
        polls."""
        if _running and _running[-1] not in _saving:
            return _running[-1]
        return None

    @property
    def saving(self) -> bool:
        """Whether this Join's ``on_save`` runs now on this rank."""
        return self in _saving

    # -- the public view joinables read -----------------------------------------------------

    @property
    def enabled(self) -> bool:
        """Whether the Join runs its protocol (``enable=True``); a disabled Join is inert."""
        return self._enable

    @property
    def joinables(self) -> tuple[Joinable, ...]:
        """The joinables in list order: the order of an iteration's collectives and hooks;
        empty once the Join has exited (it keeps none of them alive)."""
        return tuple(self._joinables)

    @property
    def elastic(self) -> bool:
        """Whether the Join goes on without lost ranks (``elastic=True``)."""
        return self._recovery.elastic

    @property
    def joined(self) -> bool:
        """Whether this rank has run out of inputs and is shadowing (or finishing)."""
        return self._joining

    @property
    def stream(self) -> BlockStream | None:
        """The ordered stream of the iteration's blocks while ranks have joined, carried by the
        announcements of the Join's :class:`~tensorplay_mpi.JoinableComm`
        (:attr:`BlockStream.orderer`), else ``None``."""
        return self._stream

    def announce(self, joinable: Joinable) -> None:
        """Announce that `joinable`'s block of collectives starts now (an active rank).

        In a Join with a :attr:`stream`, while ranks have joined, a joined rank runs the main
        hook of a joinable with ``_announces_blocks`` where its announcement is in the stream,
        between the other operations the active ranks issue (a SyncBatchNorm statistic in the
        forward pass, a loss logged after the step), instead of in list order.  Without a
        stream, when every rank is active, or outside the block, it does nothing.
        Collective over the stream's communicator while ranks have joined.
        """
        if self._stream is not None and self._enable and not self._joining:
            self._stream.announce(joinable)

    @contextlib.contextmanager
    def everywhere(self) -> Iterator[None]:
        """Around code that every rank, joined or not, runs at this point of the stream
        (``on_save``, DataParallel's ``update=``): a JoinableComm operation inside is a plain
        collective of every rank, neither announced nor followed."""
        self._everywhere_depth += 1
        try:
            yield
        finally:
            self._everywhere_depth -= 1

    @property
    def runs_everywhere(self) -> bool:
        """Whether code inside :meth:`everywhere` runs now on this rank."""
        return self._everywhere_depth > 0

    def active_ranks(self) -> int:
        """Ranks active in the current iteration: the latest heartbeat's count.

        Waits for that heartbeat if needed.  The world size when the Join is disabled, when
        this rank has joined, or before the first heartbeat.
        """
        if not self._enable or self._joining or not self._heartbeats:
            return self._comm.Get_size()
        heartbeat = self._heartbeats[-1]
        heartbeat.wait_or_abort(self._timeout)
        return heartbeat.result()

    @property
    def stopped(self) -> bool:
        """Whether a heartbeat of this Join carried a stop request of any rank.

        The same on every rank at the same iteration: it reads the latest heartbeat (waiting
        for it if needed), so check it at the top of an iteration.  It stays false while a
        joinable defers requests (:meth:`Joinable.defers_requests`: a DataParallel holding
        gradients accumulated under ``no_sync()``), so the stop lands at the next
        synchronising step.  After the block, true on
        every rank iff any heartbeat or poll of the Join carried a request.  Always false
        when the Join is disabled (no heartbeat carries anything).
        """
        if self._enable and not self._joining and self._heartbeats:
            self._heartbeats[-1].wait_or_abort(self._timeout)
        return self._requests.stopped

    def _deferring(self) -> bool:
        """Whether a joinable asks requests to wait (gradients accumulated under no_sync):
        a stop or save then lands at the next boundary where none does."""
        return any(joinable.defers_requests() for joinable in self._joinables)

    @property
    def stop_reason(self) -> str | None:
        """Why the Join stopped, when :attr:`stopped`: this rank's own request (``"SIGTERM"``,
        ...) or how many other ranks asked; else ``None``."""
        if not self.stopped:  # waits for the latest heartbeat
            return None
        return self._requests.stop_reason

    @property
    def save_due(self) -> bool:
        """Whether a save request rode a heartbeat or poll and ``on_save`` has not run for it.

        The same on every rank at the same iteration, read as :attr:`stopped` is.  Inside the
        block it is true only between that heartbeat and the next boundary, where ``on_save``
        runs; without ``on_save`` (or once the Join has stopped) it stays true, so the caller
        can save after the block.
        """
        if self._enable and not self._joining and self._heartbeats:
            self._heartbeats[-1].wait_or_abort(self._timeout)
        return self._requests.save_due

    @property
    def iterations(self) -> int:
        """Iterations of the ranks still active so far: heartbeats this rank sent plus rounds
        it shadowed.  The same on every rank inside ``on_save`` (the step of a save)."""
        return self._iterations + self._rounds

    @property
    def saves(self) -> int:
        """How many times this Join ran ``on_save`` on this rank (the same on every rank)."""
        return self._saves

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if not self._enable:  # inert: started nothing, agrees on nothing
                return
            if exc is not None:
                self._recovery.handle_failure(exc, self._heartbeats.clear)
            else:
                try:
                    self._finish_iterations()
                    self._wait_heartbeats()
                    self._run_due_save()
                    self._join_loop()
                except BaseException as error:
                    self._recovery.handle_failure(error, self._heartbeats.clear)
                    raise
                self._recovery.agree_on_the_end()
        finally:
            if self in _running:
                _running.remove(self)
            for joinable in self._joinables:
                joinable._set_join_context(None)
            self._recovery.exit()
            self._release()

    def _release(self) -> None:
        """Drop the joinables and their hooks: an exited Join (a ``with ... as join`` variable
        read for :attr:`stopped` or :attr:`saves`) keeps none of them alive, so a DataParallel
        deleted after the block can be replaced (after unfreezing parameters, say)."""
        self._joinables, self._join_hooks, self._round_hooks = [], [], []
        self._stream = None

    @staticmethod
    def notify_join_context(joinable: Joinable) -> Work | None:
        """Tell the Join that `joinable` starts an iteration: this rank still has inputs.

        Only the first joinable of an enabled, entered Join sends the heartbeat; every other
        call returns ``None``, as does a call from a hook while this rank is joined.  A later
        joinable that announces blocks (the library's optimizers) announces its block there
        when the Join has a :attr:`stream` (:meth:`announce`).

        Collective over the joinable's communicator: every active rank must call it once per
        iteration, before the iteration's other collectives.

        Returns
        -------
        Work or None
            The heartbeat; ``wait()`` then ``result()`` give the number of ranks still active
            in this iteration.  Dropping it is safe: the Join owns it and completes it.

        Raises
        ------
        tensorplay_mpi.errors.EarlyTerminationError
            In throw mode, when some rank has run out of inputs.
        TypeError
            If `joinable` skipped ``Joinable.__init__``.
        RuntimeError
            Outside a Join, if the latest Join made with `joinable` was never entered (a
            ``Join([...])`` or ``dp.join()`` written without ``with``).
        """
        join = _bound_join(joinable)
        if join is None:
            _check_not_forgotten(joinable)
            return None
        if not join._enable or join._joining:
            return None
        if join._joinables[0] is not joinable:
            if joinable._announces_blocks:
                join.announce(joinable)
            return None
        return join._heartbeat()

    def _heartbeat(self) -> Work:
        self._finish_iterations()
        if self._on_save is not None and self._heartbeats:
            self._heartbeats[-1].wait_or_abort(self._timeout)  # did it carry a save request?
            self._run_due_save()
        self._heartbeats = [w for w in self._heartbeats if not w.is_completed()]
        self._iterations += 1
        count = self._requests.heartbeat().copy()  # in place, as every library allreduce
        work = iallreduce(self._comm, MPI.IN_PLACE, count, MPI.SUM,
                          f"heartbeat (iteration {self._iterations})", finish=self._requests.read)
        self._heartbeats.append(work)
        if self._throw_on_early_termination and self._sum_over_ranks(
                0, f"throw check (iteration {self._iterations})")[0] > 0:
            raise EarlyTerminationError(
                "Detected at least one rank that exhausted inputs. Throwing across all ranks."
            )
        return work

    def _run_due_save(self) -> None:
        """Run ``on_save`` inside :meth:`everywhere` if the requests say a save is due now."""
        if self._on_save is None or not self._requests.save_now:
            return
        reason = self._requests.start_save()
        _saving.append(self)
        try:
            with self.everywhere():
                self._on_save()
        except BaseException:
            self._requests.unserved(reason)
            raise
        finally:
            _saving.remove(self)
        self._saves += 1

    def _finish_iterations(self) -> None:
        for joinable in self._joinables:
            joinable.end_iteration()

    def _wait_heartbeats(self) -> None:
        # Safe on every path: each rank started the same heartbeats in the same order.
        for work in self._heartbeats:
            work.wait_or_abort(self._timeout)
        self._heartbeats.clear()

    def _sum_over_ranks(self, value: int, what: str) -> np.ndarray:
        self._count[0] = value
        iallreduce(self._comm, MPI.IN_PLACE, self._count, MPI.SUM, what).wait_or_abort(
            self._timeout)
        return self._count

    def _join_loop(self) -> None:
        self._joining = True  # hooks calling notify_join_context get None from here on
        is_last_joiner = True
        rounds = 0
        warned = False
        while True:
            if rounds > SKEW_WARN_ROUNDS and not warned:
                warned = True
                warnings.warn(
                    f"Detected uneven input skew of greater than {SKEW_WARN_ROUNDS}. This means "
                    f"that rank {self._rank} has at least {SKEW_WARN_ROUNDS} fewer inputs than "
                    "other currently-active ranks. This level of skew could lead to performance "
                    "degradation.",
                    stacklevel=3,
                )
            if self._requests.read(self._sum_over_ranks(
                    self._requests.poll(), f"poll (round {rounds + 1} after joining)")) == 0:
                break
            if self._throw_on_early_termination:
                self._sum_over_ranks(1, "throw notice")
                raise EarlyTerminationError(f"Rank {self._rank} exhausted all inputs.")
            for hook in self._round_hooks:
                hook.main_hook()
            rounds += 1
            self._rounds = rounds
            self._run_due_save()
            is_last_joiner = False
        for hook in self._join_hooks:
            hook.post_hook(is_last_joiner)
        self._run_due_save()
