"""Work: the handle of a started nonblocking operation, the wait policy, and the abort.

This is the bottom of the library: it knows requests, buffers and deadlines, not
communicators.  Every Work is owned by a process-wide registry from the moment it starts until
it completes, whether or not its caller keeps the handle: MPI forbids freeing an incomplete
request, and buffers freed while MPI still writes them corrupt memory.  The registry is
progressed at library calls (every so many starts, so a completed operation's buffers are
released even when nobody waits for it) and completed at exit, before MPI finalizes.

Threads: under ``MPI_THREAD_MULTIPLE`` (mpi4py's default) any thread may start, test and wait
for library operations, a Work started in one thread may be waited for in another, and one
request is never tested by two threads at once (MPI forbids it): a thread that finds another
testing it skips it.  Under a lower thread level, use the library from one thread.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable, Protocol

from mpi4py import MPI

from .._resets import register
from ..errors import CollectiveTimeoutError
from ..settings import settings

# A wait spins on MPI_Test while data may be moving (a nonblocking collective progresses only
# inside MPI calls): 1 ms plus 4 ms per MB of its buffers on an oversubscribed node, 20 ms on a
# node with a core per rank (set_up() decides: spin_on_own_core()), where a rank waiting for
# slower peers (a joined rank shadowing, say) has the core to itself and a sleep would only
# answer late.  Then it sleeps between tests, 10 us doubling up to 250 us, so that a rank
# waiting long leaves the core to others, at a cost of at most 250 us of latency.  While
# spinning it yields the core after every test, which costs nothing when no other process
# wants it (MPICH's blocking waits spin the same way, without end).
_SPIN_S = 1e-3
_OWN_CORE_SPIN_S = 2e-2
_spin_s = _SPIN_S
_SPIN_BYTES_PER_S = 2.5e8
_QUICK_TESTS = 8  # tests without yielding first: a small collective is done within a few
_MIN_SLEEP_S = 1e-5
_MAX_SLEEP_S = 2.5e-4
_POLL_EVERY = 64  # tests between two looks for failure notices while spinning
_REPORT_GRACE_S = 0.5  # between printing a timeout report and aborting
_PROGRESS_EVERY = 32  # starts between two tests of every pending operation, at least

_LIKELY_CAUSES = (
    "Likely causes: (1) a joinable missing from the Join's list, so joined ranks do not "
    "shadow its collectives (Join([dp, opt]) with every optimizer, ZeroRedundancyOptimizer "
    "and JoinableComm in it); (2) a collective of your own (comm.Allreduce, comm.bcast, ...) "
    "inside a Join, which joined ranks cannot shadow: use a JoinableComm; (3) a JoinableComm "
    "operation that some active ranks do not call (a call inside a branch taken on some ranks "
    "only, a different number of calls per iteration), or jc.begin_iteration() called more "
    "or fewer times on some ranks; (4) dp.step() with uneven inputs outside a Join; (5) a "
    "rank that stalls or died outside the library.  (Calls that every rank makes but with "
    "another dtype, element count, op or root raise CollectiveMismatchError instead.)"
)
_DEBUG_HINT = " TENSORPLAY_MPI_DEBUG=1 names the first mismatched library collective."


def likely_causes() -> str:
    """Why a library wait may never end (debug mode suggested only when it is off)."""
    return _LIKELY_CAUSES + ("" if settings().debug else _DEBUG_HINT)


class Poller(Protocol):
    """What a Work polls while it waits (the guard of its communicator)."""

    broken: str | None
    """Why the communicator is unusable (its operations can never complete), else None."""

    def poll(self, what: str, since: float) -> None:
        """Raise if another rank reported a failure."""

    def report_stall(self, what: str, waited: float) -> None:
        """Say, once, that this rank has waited `waited` s for `what` (and for which ranks)."""


_pending: dict[int, Work] = {}  # id -> Work, in start order; strong references
_starts = 0  # operations started since the registry was last progressed
_swept = 0  # requests tested by sweeps of the registry so far (tests check that it stays O(n))


class Work:
    """Handle of one started nonblocking operation.

    The handle keeps the buffers of the operation alive until it completes; the library's
    registry keeps the handle alive until then, so dropping it is safe.

    Parameters
    ----------
    request : mpi4py.MPI.Request
        The started operation.
    what : str
        What the operation is, for error messages (``"heartbeat (iteration 3)"``, ...).
    keep : tuple
        Objects to keep alive until completion (the send and receive buffers).
    finish : callable, optional
        Called once on completion; its return value is :meth:`result`.
    poller : Poller, optional
        Polled for failure notices of other ranks while waiting (the communicator's guard).
    value : optional
        The :meth:`result` when there is no `finish`.
    """

    __slots__ = ("_request", "_what", "_keep", "_finish", "_result", "_done", "_testing",
                 "poller", "_void")

    def __init__(self, request: MPI.Request, what: str, keep: tuple = (),
                 finish: Callable[[], Any] | None = None, poller: Poller | None = None,
                 value: Any = None) -> None:
        self._request = request
        self._what = what
        self._keep = keep
        self._finish = finish
        self._result: Any = value
        self._done = False
        self._testing = threading.Lock()  # held by the one thread testing the request
        self.poller = poller
        self._void: str | None = None  # why its result is meaningless (a failure's drain)
        global _starts
        _starts += 1
        if _starts >= max(_PROGRESS_EVERY, len(_pending)):  # amortised O(1) a start
            sweep_pending()
        _pending[id(self)] = self

    def __repr__(self) -> str:
        state = "completed" if self._done else "pending"
        return f"<Work {self._what} {state}>"

    @property
    def what(self) -> str:
        """What the operation is."""
        return self._what

    def is_completed(self) -> bool:
        """Test for completion without blocking (this also drives MPI progress).

        False while another thread is testing the same request.
        """
        if self._done or not self._testing.acquire(blocking=False):
            return self._done
        try:
            if not self._done and self._request.Test():
                self._complete()
        finally:
            self._testing.release()
        return self._done

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the operation completes.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait at most (finite, >= 0), after which :class:`TimeoutError` is
            raised and the operation stays pending and owned by the library (wait again
            later).  ``None`` waits up to the library deadline (``$TENSORPLAY_MPI_TIMEOUT``,
            1800 s), after which :class:`~tensorplay_mpi.errors.CollectiveTimeoutError` is
            reported and the job aborted.

        Returns
        -------
        bool
            Always ``True`` (as ``mpi4py.MPI.Request.Wait`` and PyTorch's ``Work.wait``).

        Raises
        ------
        TimeoutError
            If an explicit `timeout` expired.
        TypeError, ValueError
            If `timeout` is not a number, or negative, NaN or infinite.
        tensorplay_mpi.errors.PeerFailureError
            If another rank failed while this one waited (guarded communicators).
        """
        if timeout is None:
            return self.wait_or_abort(settings().timeout)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise TypeError(f"timeout must be a number of seconds or None, got "
                            f"{type(timeout).__name__}")
        if not (timeout >= 0 and math.isfinite(timeout)):
            raise ValueError(f"timeout must be a finite number >= 0 or None, got {timeout!r}")
        if not self.wait_until(timeout):
            raise TimeoutError(f"rank {MPI.COMM_WORLD.Get_rank()}: {self._what} did not "
                               f"complete within {timeout:g} s")
        if self._void is not None:
            raise RuntimeError(self._void)
        return True

    def wait_or_abort(self, timeout: float) -> bool:
        """Wait at most `timeout` s; then report a CollectiveTimeoutError and abort the job.

        This is the one wait of every library collective.  A half-matched communicator
        cannot be reused, so a collective that does not complete in time ends the job.
        """
        start = time.monotonic()
        if not self.wait_until(timeout):
            report_and_abort(CollectiveTimeoutError(
                f"rank {MPI.COMM_WORLD.Get_rank()}: {self._what} did not complete after "
                f"{time.monotonic() - start:.1f} s (timeout {timeout:g} s); aborting the job. "
                + likely_causes()))
        if self._void is not None:
            raise RuntimeError(self._void)
        return True

    def wait_until(self, timeout: float, poll: bool = True) -> bool:
        """Test until completion (True) or until `timeout` s pass (False); never raises a
        timeout.  `poll` False skips failure notices and stall reports (the failure protocol's
        own waits).  A wait longer than ``$TENSORPLAY_MPI_STALL`` s is reported once."""
        for _ in range(_QUICK_TESTS):
            if self.is_completed():
                return True
        poller = self.poller if poll else None
        start = time.monotonic()
        stall = settings().stall if poll else 0.0
        spin, sized = _spin_s, False
        sleep, tests = _MIN_SLEEP_S, 0
        while not self.is_completed():
            tests += 1
            waited = time.monotonic() - start
            if waited >= timeout:
                return False
            if stall and waited >= stall:
                stall = 0.0  # once per wait
                _report_stall(self._what, waited, poller)
            if waited >= spin and not sized:  # sized only when needed: most waits end sooner
                spin += sum(getattr(b, "nbytes", 0) for b in self._keep) / _SPIN_BYTES_PER_S
                sized = True
            if waited < spin:
                if poller is not None and tests % _POLL_EVERY == 0:
                    poller.poll(self._what, start)
                os.sched_yield()  # lets a peer sharing this core run (as MPICH's Wait does)
                continue
            if poller is not None:
                poller.poll(self._what, start)
            time.sleep(min(sleep, timeout - waited))
            sleep = min(2 * sleep, _MAX_SLEEP_S)
        return True

    def result(self) -> Any:
        """The operation's result; only after completion (:meth:`wait` first).

        Raises
        ------
        RuntimeError
            If the operation has not completed yet.
        """
        if not self.is_completed():
            raise RuntimeError(f"{self._what} has not completed yet; call wait() before result()")
        if self._void is not None:
            raise RuntimeError(self._void)
        return self._result

    def void(self, why: str) -> None:
        """Mark the operation's outcome meaningless: a failure's drain
        (:mod:`~tensorplay_mpi.comm._drain`) completes it with scratch contributions.  Its
        completion callback is dropped; waiting for it or reading its result then raises
        ``RuntimeError(why)``."""
        self._void, self._finish = why, None

    def release_if_failed(self, why: str) -> bool:
        """Test once; an operation that MPI ended in error (one on a revoked communicator)
        completes with a void result (`why`).  Whether it has completed."""
        if self._done or not self._testing.acquire(blocking=False):
            return self._done
        try:
            try:
                done = self._request.Test()
            except MPI.Exception:
                self.void(why)
                done = True
            if done and not self._done:
                self._complete()
        finally:
            self._testing.release()
        return self._done

    def abandon(self, why: str) -> None:
        """Give the operation up without completing it: its communicator was revoked and MPI
        will never complete it (the request is left to MPI); its result is void (`why`)."""
        self.void(why)
        self._complete()

    def _complete(self) -> None:
        self._done = True
        _pending.pop(id(self), None)
        if self._finish is not None:
            self._result = self._finish()
        self._keep, self._finish = (), None


def _report_stall(what: str, waited: float, poller: Poller | None) -> None:
    if poller is not None:
        poller.report_stall(what, waited)  # asks the other ranks where they are, then prints
        return
    sys.stderr.write(f"tensorplay_mpi: rank {MPI.COMM_WORLD.Get_rank()} has waited "
                     f"{waited:.0f} s for {what}; still waiting. {likely_causes()}\n")
    sys.stderr.flush()


def report_and_abort(error: BaseException) -> None:
    """Print `error` with the stack that led to it, abort the job, and raise `error` should
    the abort return.

    Always ``COMM_WORLD``: with MPICH's hydra, ``MPI_Abort`` on a duplicate communicator left
    the other ranks running until an outer timeout in 2 runs of 8 here; on ``COMM_WORLD`` it
    ended the job every time.  Without the pause before it, hydra dropped the report of
    every rank in 3 runs of 20.
    """
    stack = "".join(traceback.format_stack()[:-2])
    sys.stderr.write(f"{stack}{type(error).__module__}.{type(error).__name__}: {error}\n")
    sys.stderr.flush()
    time.sleep(_REPORT_GRACE_S)  # the launcher forwards the report before the abort kills it
    MPI.COMM_WORLD.Abort(1)
    raise error


def spin_on_own_core(own: bool) -> None:
    """Spin longer in a wait (20 ms, not 1 ms) before sleeping: this rank has a core to itself
    (`own`; :func:`~tensorplay_mpi._process.set_up` decides, from the ranks on the node)."""
    global _spin_s
    _spin_s = _OWN_CORE_SPIN_S if own else _SPIN_S


def _default_spin() -> None:
    spin_on_own_core(False)


register(_default_spin)


def outstanding_requests() -> int:
    """Number of operations started in this process that have not completed yet."""
    return len(_pending)


def sweep_pending() -> None:
    """Test every pending operation once, completing those that are done (and releasing their
    buffers).  New Works do it every ``max(32, pending)`` starts, so dropped Works do not pile
    up, at an amortised O(1) a start.

    One sweep is one ``MPI_Testsome`` over the pending requests that no other thread is testing
    at the moment (those are skipped: MPI forbids two threads testing one request at once).
    """
    global _starts, _swept
    _starts = 0
    held = []
    for work in list(_pending.values()):
        if work._testing.acquire(blocking=False):
            if work._done:
                work._testing.release()
            else:
                held.append(work)
    if not held:
        return
    _swept += len(held)
    try:
        requests = [work._request for work in held]
        done = set(MPI.Request.Testsome(requests) or ())  # persistent ones stay non-null
        for i, (work, request) in enumerate(zip(held, requests)):
            if (i in done or not request) and not work._done:  # or a null request from start
                work._complete()
    finally:
        for work in held:
            work._testing.release()


def sweep_tests() -> int:
    """How many requests the registry's sweeps (:func:`sweep_pending`) have tested in this
    process: it grows by O(1) a start, whatever is pending."""
    return _swept


def pending_of(poller: Poller | None) -> list[Work]:
    """The pending operations polled by `poller` (those of one guarded communicator), in start
    order."""
    return [w for w in list(_pending.values()) if w.poller is poller]


def complete_pending(poller: Poller | None, timeout: float) -> None:
    """Wait for every pending operation polled by `poller` (the operations of one guarded
    communicator), in start order; abort the job if one does not complete within `timeout`."""
    for work in pending_of(poller):
        work.wait_or_abort(timeout)


def complete_all_at_exit() -> None:
    """Before MPI finalizes: complete what is still pending, or end the job if it cannot
    (the exit hook that :mod:`tensorplay_mpi._process` registers)."""
    if not _pending or MPI.Is_finalized():
        return
    deadline = time.monotonic() + settings().grace
    for work in list(_pending.values()):
        broken = getattr(work.poller, "broken", None)  # then it can never complete: no wait
        if broken is None and work.wait_until(max(0.0, deadline - time.monotonic()), poll=False):
            continue
        why = (f"on a communicator left unusable by {broken}" if broken is not None
               else "that other ranks never matched")
        report_and_abort(RuntimeError(
            f"rank {MPI.COMM_WORLD.Get_rank()}: the process exits with {len(_pending)} library "
            f"operation(s) {why} ({work.what} first); aborting so that the job ends"))

