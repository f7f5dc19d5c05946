"""The guard of a communicator: failure notices, the failure agreement, debug checks.

A Guard is attached (as an MPI attribute, freed with the communicator) to every communicator
that a Join or a library joinable uses; the collective wrappers of :mod:`tensorplay_mpi.comm`
look it up there and hand it to each :class:`~tensorplay_mpi.comm.Work` they start, which polls
it while waiting.  It owns two private duplicates:

``notices``
    A rank that leaves a Join or a step through an exception sends a notice (its rank, whether
    the failure is its own, the exception's type and message) to every other rank.  Every
    library wait on the guarded communicator looks for notices; after a short grace it agrees on
    the failure and raises :class:`~tensorplay_mpi.errors.PeerFailureError`.  The
    failure agreement is one ``Iallreduce(MAX)`` on ``notices`` of whether the failure was
    another rank's, and of how far the rank got: the collectives it started on the guarded
    communicator (:attr:`Guard.started`), plus and minus, so that the maximum gives both the
    highest and the lowest count.  It is bounded by ``$TENSORPLAY_MPI_GRACE`` (10 s).  When
    every rank failed on its own (one bug on all ranks) AND every rank started the same
    collectives, the communicator is intact: pending requests are completed and each rank's
    exception propagates unchanged.  Otherwise, or when some rank does not come to agree in
    time, it is broken: a collective that one rank started and another did not would be matched
    by the next one and give wrong numbers, so the exceptions propagate (with ``python -m
    mpi4py`` the job aborts) and every later library collective on it raises at once.
    The same communicator carries the stall report's questions and answers
    (:mod:`tensorplay_mpi.comm._stall`).
``checks``
    With ``TENSORPLAY_MPI_DEBUG=1``, before every library collective the ranks allgather its
    signature (kind, count, dtype, op, root) and raise
    :class:`~tensorplay_mpi.errors.CollectiveMismatchError` on every rank if they differ.
    When a guard is made, the ranks first compare there whether debug mode is on: on some
    ranks only, its checks would hang the first collective, so it raises ``ValueError`` on
    every rank instead.
"""

from __future__ import annotations

import pickle
import time
from typing import Callable, NamedTuple

import numpy as np
from mpi4py import MPI

from ..errors import CollectiveMismatchError, PeerFailureError
from ..settings import settings
from ._agreement import agree, agree_on_setting
from ._drain import ReplayLog, drain
from ._fault_tolerance import is_process_failure, known_lost_ranks
from ._stall import ANSWER_TAG, QUERY_TAG, StallReport, answer
from ._work import Work

NOTICE_GRACE_S = 0.25
"""Seconds a wait goes on after a failure notice before it raises PeerFailureError."""

_NOTICE_TAG = 0x7E11
_SIGNATURE_BYTES = 96  # per part: the signature compared, and what it is for (shown)
_COLLECTIVES = ("allreduce", "bcast", "allgather")
_KEYVAL = MPI.Comm.Create_keyval(delete_fn=lambda comm, keyval, guard: guard.free())


class Verdict(NamedTuple):
    """The outcome of a failure agreement (:meth:`Guard.agree_on_failure`)."""

    intact: bool
    """True iff every rank failed on its own, at the same point: the communicator is usable."""
    caller_completes: int
    """The highest `caller_completes` any rank reported (meaningful when intact)."""


def _idup(comm: MPI.Intracomm, what: str) -> MPI.Intracomm:
    """A duplicate of `comm`, under the library deadline (a rank that never comes is reported)."""
    dup, request = comm.Idup()
    Work(request, f"{what} (the first Join or joinable on a communicator is collective: every "
         "rank must make it)").wait_or_abort(settings().timeout)
    return dup


class Guard:
    """Failure notices, failure agreement and debug checks of one communicator."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._comm = MPI.Intracomm(comm)  # the guarded one (a handle, not the caller's object)
        self.log = ReplayLog()  # the latest collectives started on it, for a drain
        self.notices = _idup(comm, "the guard's failure-notice communicator")
        self.checks = _idup(comm, "the guard's debug-check communicator")
        self.received: list[tuple] = []  # notices of the failure being agreed on
        self._first_notice: float | None = None
        self._agreed: tuple[BaseException, Verdict] | None = None  # the latest failure agreed on
        self.broken: str | None = None
        self.replica_check_due = False  # a failure was judged intact: check the replicas
        self.started = 0  # collectives started on the guarded communicator (and their checks)
        self._stall: StallReport | None = None  # a stall report waiting for answers
        self._sent: list[np.ndarray] = []  # payloads of stall messages, kept while MPI may read
        try:
            self._check_debug_everywhere()
        except BaseException:
            self.free()
            raise

    def _check_debug_everywhere(self) -> None:
        """Raise ``ValueError`` on every rank unless debug mode is on everywhere or nowhere (on
        ``checks``, where its signature checks run)."""
        what = "the debug-mode check of a new communicator"
        agree_on_setting(lambda row, every: Work(self.checks.Iallgather(row, every), what,
                                                 (row, every), None, self),
                         self.rank, self.size, settings().timeout, settings().debug,
                         "TENSORPLAY_MPI_DEBUG", "its checks are collectives of their own")

    @staticmethod
    def of(comm: MPI.Comm) -> "Guard | None":
        """The guard attached to `comm`, if any."""
        guard = comm.Get_attr(_KEYVAL)
        return guard if isinstance(guard, Guard) else None

    @classmethod
    def attach(cls, comm: MPI.Intracomm) -> "Guard":
        """The guard of `comm`, made on first use.

        Collective over `comm` the first time: every rank must call it.

        Raises
        ------
        ValueError
            The first time, on every rank, if ``TENSORPLAY_MPI_DEBUG`` differs across ranks.
        """
        guard = cls.of(comm)
        if guard is None:
            guard = cls(comm)
            comm.Set_attr(_KEYVAL, guard)
        return guard

    def private(self) -> list[MPI.Intracomm]:
        """The guard's own duplicates of the guarded communicator (``notices``, ``checks``)."""
        return [self.notices, self.checks]

    def free(self) -> None:
        """Free the private communicators (called when the guarded one is freed)."""
        if not MPI.Is_finalized():
            self.notices.Free()
            self.checks.Free()

    # -- every library collective ----------------------------------------------------------

    def before_collective(self, kind: str, what: str,
                          signature: Callable[[], str] | None,
                          description: tuple | None = None) -> None:
        """Refuse a broken communicator; count a collective (and log its `description`,
        :func:`~tensorplay_mpi.comm._drain.replay`); in debug mode, check that every rank issues
        the same."""
        if self.broken is not None:
            raise self._unusable(f"cannot start {what}")
        if kind in _COLLECTIVES:
            if settings().debug and signature is not None:
                self.started += 1  # the check is an operation of its own (on ``checks``)
                self.log.append(None)
                self._check_signatures(signature(), what)
            self.started += 1
            self.log.append(description)

    def _check_signatures(self, signature: str, what: str) -> None:
        texts = agree(lambda row, every: Work(self.checks.Iallgather(row, every),
                                              f"signature check before {what}", (row, every),
                                              None, self),
                      self.rank, self.size, f"signature check before {what}",
                      settings().timeout, text=f"{signature[:_SIGNATURE_BYTES]}\n{what}",
                      text_bytes=2 * _SIGNATURE_BYTES).texts
        signatures = [text.partition("\n")[0] for text in texts]
        if any(s != signatures[0] for s in signatures):
            rows = [f"  rank {r}: {text.replace(chr(10), '  [', 1)}]"
                    for r, text in enumerate(texts)]
            raise CollectiveMismatchError(
                "ranks are about to issue different collectives on one communicator:\n"
                + "\n".join(rows))

    def poll(self, what: str, since: float) -> None:
        """Agree on the failure and raise PeerFailureError once another rank's failure notice
        is older than the grace.

        The grace (:data:`NOTICE_GRACE_S`, counted from the notice or from `since`, the start of the
        current wait, whichever is later) lets an operation that the failed rank had already
        started complete: when every rank fails at the same point after a collective, each
        rank then raises its own exception, not a PeerFailureError, and the communicator stays
        usable.
        """
        if self.broken is not None:  # started before the verdict: it can never complete
            raise self._unusable(f"{what} cannot complete")
        while self._receive(what):
            pass
        if self._stall is not None and self._stall.due():
            self._stall.print()
            self._stall = None
        first = self._first_notice  # set iff a notice is being agreed on
        if first is not None and time.monotonic() - max(first, since) > NOTICE_GRACE_S:
            rank, _, kind, message = self.received[0]
            error = PeerFailureError(f"rank {self.rank}: rank {rank} failed with {kind}: "
                                     f"{message} (while this rank waited for {what})")
            self.agree_on_failure(error)  # a PeerFailureError leaves every library call agreed on
            raise error

    def _unusable(self, what: str) -> RuntimeError:
        return RuntimeError(f"rank {self.rank}: {what}: the communicator is unusable after "
                            f"{self.broken}; end the job")

    def drain(self) -> None:
        """Receive what is waiting on ``notices`` (stall questions and late answers)."""
        if self.broken is None:
            while self._receive("nothing (between Joins)"):
                pass

    def report_stall(self, what: str, waited: float) -> None:
        """Ask every other rank where it is; the next polls print the answers (one line)."""
        self._stall = StallReport(self.notices, self.rank, self.started, what, waited,
                                  self._sent)

    # -- the failure path ------------------------------------------------------------------------

    def agree_on_failure(self, error: BaseException, caller_completes: int = 0) -> Verdict:
        """Tell every rank about `error`, agree, and say whether the communicator is intact.

        Called by every rank that leaves a Join or a step through an exception, and by a wait
        that raises PeerFailureError.  Two rounds: the agreement, then a confirmation that
        every rank completed it (a rank that gave up waiting for a late one does not confirm,
        so the late one cannot take the communicator for intact).  Agreeing on the same exception
        again returns the same verdict, so an exception that leaves a step and then its Join
        is agreed on once.  Each round waits for the other ranks at most
        ``$TENSORPLAY_MPI_GRACE`` seconds; a rank whose peers do not come (they are busy
        outside the library, or gone) marks the communicator broken and lets its own exception
        propagate.

        Parameters
        ----------
        error : BaseException
            The exception this rank leaves with.
        caller_completes : int, default 0
            How many of the collectives this rank started the caller will complete itself
            when the verdict is intact (DataParallel's buckets of the failed step: a rank that
            started fewer starts the missing ones).  The other collectives must match exactly.

        Returns
        -------
        Verdict
            ``intact`` iff every rank failed on its own and every rank started the same
            collectives apart from `caller_completes`; ``caller_completes``, the highest
            over ranks.
        """
        if self._agreed is not None and self._agreed[0] is error:
            return self._agreed[1]
        if self.broken is None and is_process_failure(error, self._comm):  # no agreement
            self.broken = f"the loss of rank(s) {known_lost_ranks(self._comm)} ({error})"
        if self.broken is not None:
            verdict = Verdict(False, caller_completes)
        else:
            verdict = self._agree(error, caller_completes)
            self.replica_check_due = self.replica_check_due or verdict.intact
        self._agreed = (error, verdict)
        return verdict

    def forget_failure(self) -> None:
        """Drop the latest exception agreed on (a Join's exit: nothing agrees on it again)."""
        self._agreed = None

    def _agree(self, error: BaseException, caller_completes: int) -> Verdict:
        grace = settings().grace
        deadline = time.monotonic() + grace
        own = not isinstance(error, PeerFailureError)
        notice = (self.rank, own, type(error).__name__, str(error))
        payload = np.frombuffer(pickle.dumps(notice), np.uint8)
        sends = [Work(self.notices.Isend(payload, r, _NOTICE_TAG), f"failure notice to {r}",
                      (payload,)) for r in range(self.size) if r != self.rank]
        matched = self.started - caller_completes  # collectives that every rank must have started
        flags = np.array([int(not own), matched, -matched, caller_completes], np.int64)
        if not self._all_come(flags, MPI.MAX, "failure agreement", grace):
            self.broken = (f"a failure ({type(error).__name__}) that not every rank came to "
                           f"agree on within {grace:g} s (TENSORPLAY_MPI_GRACE)")
            return Verdict(False, caller_completes)
        # A rank that gave up waiting above is broken, and comes to no second round: a rank
        # that came after it (its agreement matched the given-up one) learns it here.
        if not self._all_come(np.ones(1, np.int64), MPI.MIN, "failure agreement (second "
                              "round)", grace):
            self.broken = (f"a failure ({type(error).__name__}) that a rank gave up agreeing "
                           f"on (it came more than {grace:g} s, TENSORPLAY_MPI_GRACE, after "
                           "another)")
            return Verdict(False, caller_completes)
        # every notice was sent before the agreement could complete
        while len(self.received) < self.size - 1 and time.monotonic() < deadline:
            self._receive("the failure agreement")
        for send in sends:  # every rank receives them all, as this one did
            send.wait_until(max(0.0, deadline - time.monotonic()), poll=False)
        shared, most, fewest = int(flags[0]) == 0, int(flags[1]), -int(flags[2])
        if not shared:
            failed = {r: kind for r, was_own, kind, _ in self.received if was_own}
            failed.update({self.rank: type(error).__name__} if own else {})
            kinds = ", ".join(sorted(set(failed.values())))
            self.broken = (f"a failure on rank(s) {sorted(failed)} ({kinds}) that other ranks "
                           "did not share")
        elif most != fewest:
            self.broken = (f"a failure that every rank raised, but at different points: some "
                           f"rank had started {most} collectives on the communicator, another "
                           f"{fewest} (this rank {matched}), so an operation is unmatched")
        self.received.clear()
        self._first_notice = None
        if self.broken is not None:  # every rank came: complete what is pending, if exactly
            drain(self, self._comm, deadline + grace)
        return Verdict(self.broken is None, int(flags[3]))


    def _all_come(self, flags: np.ndarray, op: MPI.Op, what: str, grace: float) -> bool:
        """``Iallreduce(IN_PLACE, flags, op)`` on ``notices``; False if not every rank comes
        within `grace` s (the operation then stays pending, on a broken communicator)."""
        work = Work(self.notices.Iallreduce(MPI.IN_PLACE, flags, op), what, (flags,), None, self)
        return work.wait_until(grace, poll=False)

    def _receive(self, what: str) -> bool:
        """Receive one pending message on ``notices``, if there is one: a failure notice (kept
        in :attr:`received`), a stall question (answered: this rank waits for `what`) or a
        stall answer (for the report in progress; a late one is dropped)."""
        status = MPI.Status()
        if not self.notices.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
            return False
        source, tag = status.Get_source(), status.Get_tag()
        payload = np.empty(status.Get_count(MPI.BYTE), np.uint8)
        self.notices.Recv(payload, source, tag)  # matched: returns at once
        message = pickle.loads(payload.tobytes())
        if tag == _NOTICE_TAG:
            self.received.append(message)
            if self._first_notice is None:
                self._first_notice = time.monotonic()
        elif tag == QUERY_TAG:
            answer(self.notices, source, (self.rank, self.started, what), self._sent)
        elif tag == ANSWER_TAG and self._stall is not None:
            self._stall.add(*message)
        return True

