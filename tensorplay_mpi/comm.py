"""The single start-then-wait path of every library collective.

MPI matches collectives per communicator in start order, and a blocking collective never matches
a nonblocking one.  Every collective that tensorplay_mpi issues, and every shadow a join hook
issues, therefore starts a nonblocking operation here and completes it through :class:`Work`.
Custom joinables should use these functions too (never ``comm.Allreduce`` and friends), so that
a joined rank's shadow always matches what an active rank issued.

Every wait has a deadline and polls, on a guarded communicator (one used by a Join, a
DataParallel or a ZeroRedundancyOptimizer), for failure notices of other ranks; see
:mod:`tensorplay_mpi.guard`.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from .buffers import Staging
from .errors import CollectiveTimeoutError

__all__ = [
    "Work",
    "iallreduce",
    "ibcast",
    "iallgather",
    "iallgatherv",
    "isend",
    "irecv",
    "default_comm",
    "default_timeout",
    "resolve_timeout",
    "check_comm",
    "outstanding_requests",
    "OPS",
    "op_name",
]

_outstanding = 0  # started and not yet completed Works, process-wide (tests check it is 0)

# A wait spins on MPI_Test while data may be moving (a nonblocking collective progresses only
# inside MPI calls): 1 ms plus 4 ms per MB of its buffers.  Then it sleeps between
# tests, 10 us doubling up to 250 us, so that a rank waiting for slower peers leaves the core to
# them on an oversubscribed node, at a cost of at most 250 us of latency.  While spinning it
# yields the core after every test, which costs nothing when no other process wants it.
_SPIN_S = 1e-3
_SPIN_BYTES_PER_S = 2.5e8
_MIN_SLEEP_S = 1e-5
_MAX_SLEEP_S = 2.5e-4
_POLL_EVERY = 64  # tests between two looks for failure notices while spinning
_REPORT_GRACE_S = 0.5  # between printing a timeout report and aborting

GUARD_KEYVAL = MPI.Comm.Create_keyval(delete_fn=lambda comm, keyval, guard: guard.free())
"""Attribute key of a communicator's :class:`~tensorplay_mpi.guard.Guard`."""


def default_timeout() -> float:
    """Seconds a library wait may take: ``$TENSORPLAY_MPI_TIMEOUT``, default 1800.

    Raises
    ------
    ValueError
        If the variable is set to something that is not a positive number.
    """
    text = os.environ.get("TENSORPLAY_MPI_TIMEOUT", "1800")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"TENSORPLAY_MPI_TIMEOUT must be a positive number of seconds, "
                         f"got {text!r}")
    return value


def resolve_timeout(timeout: float | None) -> float:
    """`timeout` checked to be positive, or :func:`default_timeout` for ``None``."""
    if timeout is None:
        return default_timeout()
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


class Work:
    """Handle of one started nonblocking operation.

    The handle owns the MPI request and keeps the buffers of the operation alive until it
    completes (MPI forbids freeing or reusing them earlier).

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
    guard : tensorplay_mpi.guard.Guard, optional
        The guard of the operation's communicator, polled for failure notices while waiting.
    value : optional
        The :meth:`result` when there is no `finish`.
    """

    __slots__ = ("_request", "_what", "_keep", "_finish", "_result", "_done", "_guard")

    def __init__(self, request: MPI.Request, what: str, keep: tuple = (),
                 finish: Callable[[], Any] | None = None, guard: Any = None,
                 value: Any = None) -> None:
        global _outstanding
        self._request = request
        self._what = what
        self._keep = keep
        self._finish = finish
        self._result: Any = value
        self._done = False
        self._guard = guard
        _outstanding += 1

    def __repr__(self) -> str:
        state = "completed" if self._done else "pending"
        return f"<Work {self._what} {state}>"

    @property
    def what(self) -> str:
        """What the operation is."""
        return self._what

    def is_completed(self) -> bool:
        """Test for completion without blocking (this also drives MPI progress)."""
        if not self._done and self._request.Test():
            self._complete()
        return self._done

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the operation completes.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait at most, after which :class:`TimeoutError` is raised and the
            operation stays pending and owned by this handle (wait again later).  ``None``
            waits up to the library deadline (``$TENSORPLAY_MPI_TIMEOUT``, 1800 s), after
            which :class:`~tensorplay_mpi.errors.CollectiveTimeoutError` is reported and the
            communicator aborted.

        Returns
        -------
        bool
            Always ``True`` (as ``mpi4py.MPI.Request.Wait`` and PyTorch's ``Work.wait``).

        Raises
        ------
        TimeoutError
            If an explicit `timeout` expired.
        tensorplay_mpi.errors.PeerFailureError
            If another rank failed while this one waited (guarded communicators).
        """
        if timeout is None:
            return self.wait_or_abort(default_timeout())
        if timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout!r}")
        waited = self._wait_until(timeout)
        if waited is not None:
            raise TimeoutError(f"rank {MPI.COMM_WORLD.Get_rank()}: {self._what} did not "
                               f"complete within {timeout:g} s")
        return True

    def wait_or_abort(self, timeout: float, poll: bool = True) -> bool:
        """Wait at most `timeout` s; then report a CollectiveTimeoutError and abort.

        This is the one wait of every library collective.  A half-matched communicator
        cannot be reused, so a collective that does not complete in time ends the job.
        `poll` False skips failure notices (the failure protocol's own waits).
        """
        waited = self._wait_until(timeout, poll)
        if waited is not None:
            error = CollectiveTimeoutError(
                f"rank {MPI.COMM_WORLD.Get_rank()}: {self._what} did not complete after "
                f"{waited:.1f} s (timeout {timeout:g} s); aborting the job")
            _report_and_abort(error)
        return True

    def _wait_until(self, timeout: float, poll: bool = True) -> float | None:
        """Test until completion (None) or until `timeout` passes (the seconds waited)."""
        if self.is_completed():
            return None
        guard = self._guard if poll else None
        start = time.monotonic()
        spin, sized = _SPIN_S, False
        sleep, tests = _MIN_SLEEP_S, 0
        while not self.is_completed():
            tests += 1
            waited = time.monotonic() - start
            if waited >= timeout:
                return waited
            if waited >= spin and not sized:  # sized only when needed: most waits end sooner
                spin += sum(getattr(b, "nbytes", 0) for b in self._keep) / _SPIN_BYTES_PER_S
                sized = True
            if waited < spin:
                if guard is not None and tests % _POLL_EVERY == 0:
                    guard.poll(self._what, start)
                os.sched_yield()  # lets a peer sharing this core run (as MPICH's Wait does)
                continue
            if guard is not None:
                guard.poll(self._what, start)
            time.sleep(min(sleep, timeout - waited))
            sleep = min(2 * sleep, _MAX_SLEEP_S)
        return None

    def result(self) -> Any:
        """The operation's result; only after completion (:meth:`wait` first).

        Raises
        ------
        RuntimeError
            If the operation has not completed yet.
        """
        if not self.is_completed():
            raise RuntimeError(f"{self._what} has not completed yet; call wait() before result()")
        return self._result

    def _complete(self) -> None:
        global _outstanding
        self._done = True
        _outstanding -= 1
        if self._finish is not None:
            self._result = self._finish()
        self._keep = self._finish = None


def _report_and_abort(error: BaseException) -> None:
    """Print `error` with the stack that led to it, then abort the job.

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


def outstanding_requests() -> int:
    """Number of Works started in this process that have not completed yet."""
    return _outstanding


def default_comm() -> MPI.Intracomm:
    """The communicator used when none is given: ``MPI.COMM_WORLD``."""
    return MPI.COMM_WORLD


def check_comm(comm: Any, name: str = "comm") -> MPI.Intracomm:
    """Return `comm` if it is a usable intra-communicator, else raise.

    Raises
    ------
    TypeError
        If `comm` is not an ``mpi4py.MPI.Intracomm`` (an inter-communicator, say).
    ValueError
        If `comm` is ``MPI.COMM_NULL``.
    """
    if isinstance(comm, MPI.Comm) and comm == MPI.COMM_NULL:
        raise ValueError(f"{name} is MPI.COMM_NULL")
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"{name} must be an mpi4py.MPI.Intracomm, got {type(comm).__name__}")
    return comm


def _start(comm: MPI.Comm, what: str, kind: str, start: Callable[..., MPI.Request],
           args: tuple, keep: tuple, result: Callable[[], Any] | None, staging: Staging | None,
           signature: Callable[[], str] | None = None, value: Any = None) -> Work:
    """The one place where every library operation starts.

    `staging` None: host buffers, nothing staged, the result is `value`.
    """
    guard = comm.Get_attr(GUARD_KEYVAL)
    if guard is not None:
        guard.before_collective(kind, what, signature)
    if staging is None:
        return Work(start(*args), what, keep, None, guard, value)
    finish = result
    if staging.copies_back:
        def finish() -> Any:
            staging.finish()
            return result() if result is not None else None

    # host copies of staged buffers live as long as their device buffer, which `keep` holds
    return Work(start(*args), what, keep, finish, guard)


OPS = ("SUM", "PROD", "MAX", "MIN", "LAND", "LOR", "LXOR", "BAND", "BOR", "BXOR")
"""The predefined reductions by name (what signatures and announcements can describe)."""


def op_name(op: MPI.Op) -> str | None:
    """The name of a predefined reduction from :data:`OPS`, else ``None``."""
    return next((name for name in OPS if op == getattr(MPI, name)), None)


def _describe(buf: Any) -> str:
    if buf is MPI.IN_PLACE:
        return "IN_PLACE"
    dtype, size = getattr(buf, "dtype", None), getattr(buf, "size", None)
    return f"{size}x{dtype}" if dtype is not None else type(buf).__name__


def iallreduce(
    comm: MPI.Intracomm,
    sendbuf: Any,
    recvbuf: Any,
    op: MPI.Op = MPI.SUM,
    what: str = "allreduce",
    *,
    finish: Callable[[Any], Any] | None = None,
) -> Work:
    """Start ``MPI_Iallreduce``; the Work's result is `recvbuf`, or ``finish(recvbuf)``.

    Collective over `comm`: every rank must call it.  `sendbuf` may be ``MPI.IN_PLACE``.
    """
    def signature() -> str:
        return f"allreduce {_describe(recvbuf)} op={op_name(op) or 'user-defined'}"

    if finish is None and type(recvbuf) is np.ndarray and (
            sendbuf is MPI.IN_PLACE or type(sendbuf) is np.ndarray):  # host: the fast path
        return _start(comm, what, "allreduce", comm.Iallreduce, (sendbuf, recvbuf, op),
                      (sendbuf, recvbuf), None, None, signature, recvbuf)
    staging = Staging()
    if sendbuf is MPI.IN_PLACE:
        args = (sendbuf, staging.update(recvbuf), op)
    else:
        args = (staging.read(sendbuf), staging.write(recvbuf), op)
    result = (lambda: recvbuf) if finish is None else (lambda: finish(recvbuf))
    return _start(comm, what, "allreduce", comm.Iallreduce, args, (sendbuf, recvbuf), result,
                  staging, signature)


def ibcast(comm: MPI.Intracomm, buf: Any, root: int, what: str = "bcast") -> Work:
    """Start ``MPI_Ibcast`` of `buf` from `root`; the Work's result is `buf`.

    Collective over `comm`: every rank must call it.
    """
    def signature() -> str:
        return f"bcast {_describe(buf)} root={root}"

    if type(buf) is np.ndarray:  # host: the fast path
        return _start(comm, what, "bcast", comm.Ibcast, (buf, root), (buf,), None, None,
                      signature, buf)
    staging = Staging()
    mpi_buf = staging.read(buf) if comm.Get_rank() == root else staging.write(buf)
    return _start(comm, what, "bcast", comm.Ibcast, (mpi_buf, root), (buf,), lambda: buf,
                  staging, signature)


def iallgather(comm: MPI.Intracomm, sendbuf: Any, recvbuf: Any, what: str = "allgather") -> Work:
    """Start ``MPI_Iallgather``; the Work's result is `recvbuf`.

    Collective over `comm`: every rank must call it.
    """
    staging = Staging()
    args = (staging.read(sendbuf), staging.write(recvbuf))
    return _start(comm, what, "allgather", comm.Iallgather, args, (sendbuf, recvbuf),
                  lambda: recvbuf, staging, lambda: f"allgather {_describe(sendbuf)}")


def iallgatherv(comm: MPI.Intracomm, sendbuf: Any, recvbuf: Any, counts: list[int],
                what: str = "allgatherv") -> Work:
    """Start ``MPI_Iallgatherv``: rank ``r`` sends ``counts[r]`` elements, gathered in rank order.

    Collective over `comm`: every rank must call it with the same `counts`.
    """
    staging = Staging()
    args = (staging.read(sendbuf), [staging.write(recvbuf), counts])
    return _start(comm, what, "allgather", comm.Iallgatherv, args, (sendbuf, recvbuf),
                  lambda: recvbuf, staging, lambda: f"allgatherv {_describe(recvbuf)}")


def isend(comm: MPI.Intracomm, buf: Any, dest: int, tag: int, what: str = "send") -> Work:
    """Start a point-to-point ``MPI_Isend`` of `buf` to `dest`."""
    staging = Staging()
    return _start(comm, what, "send", comm.Isend, (staging.read(buf), dest, tag), (buf,), None,
                  staging)


def irecv(comm: MPI.Intracomm, buf: Any, source: int, tag: int, what: str = "recv") -> Work:
    """Start a point-to-point ``MPI_Irecv`` into `buf` from `source`; the result is `buf`."""
    staging = Staging()
    return _start(comm, what, "recv", comm.Irecv, (staging.write(buf), source, tag), (buf,),
                  lambda: buf, staging)
