"""The single start-then-wait path of every library collective.

MPI matches collectives per communicator in start order, and a blocking collective never matches
a nonblocking one.  Every collective that tensorplay_mpi issues, and every shadow a join hook
issues, therefore starts a nonblocking operation here and completes it through :class:`Work`.
Custom joinables should use these functions too (never ``comm.Allreduce`` and friends), so that
a joined rank's shadow always matches what an active rank issued.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from mpi4py import MPI

__all__ = [
    "Work",
    "iallreduce",
    "ibcast",
    "iallgather",
    "isend",
    "irecv",
    "default_comm",
    "check_comm",
    "outstanding_requests",
]

_outstanding = 0  # started and not yet completed Works, process-wide (tests check it is 0)

# A wait with a deadline polls MPI_Test: it spins this long first (low latency, full progress),
# then sleeps with exponential back-off so an oversubscribed node is not burned by idle ranks.
_SPIN_S = 1e-3
_MAX_SLEEP_S = 1e-3


class Work:
    """Handle of one started nonblocking collective.

    The handle owns the MPI request and keeps the buffers of the operation alive until it
    completes (MPI forbids freeing or reusing them earlier).

    Parameters
    ----------
    request : mpi4py.MPI.Request
        The started operation.
    what : str
        What the operation is, for error messages (``"heartbeat"``, ``"poll"``, ...).
    keep : tuple
        Objects to keep alive until completion (the send and receive buffers).
    finish : callable, optional
        Called once on completion; its return value is :meth:`result`.
    """

    __slots__ = ("_request", "_what", "_keep", "_finish", "_result", "_done")

    def __init__(
        self,
        request: MPI.Request,
        what: str,
        keep: tuple = (),
        finish: Callable[[], Any] | None = None,
    ) -> None:
        global _outstanding
        self._request = request
        self._what = what
        self._keep = keep
        self._finish = finish
        self._result: Any = None
        self._done = False
        _outstanding += 1

    def __repr__(self) -> str:
        state = "completed" if self._done else "pending"
        return f"<Work {self._what} {state}>"

    @property
    def what(self) -> str:
        """What the operation is (``"heartbeat"``, ``"poll"``, ...)."""
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
            Seconds to wait at most; ``None`` waits forever.

        Returns
        -------
        bool
            Always ``True`` (as ``mpi4py.MPI.Request.Wait`` and PyTorch's ``Work.wait``).

        Raises
        ------
        TimeoutError
            If the operation did not complete within `timeout`.  The operation stays
            pending and owned by this handle: wait again later.
        """
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout!r}")
        if self._done:
            return True
        if timeout is None:
            self._request.Wait()
            self._complete()
            return True
        start = time.monotonic()
        sleep = 1e-6
        while not self.is_completed():
            waited = time.monotonic() - start
            if waited >= timeout:
                raise TimeoutError(
                    f"rank {MPI.COMM_WORLD.Get_rank()}: {self._what} did not complete "
                    f"within {timeout:g} s"
                )
            if waited > _SPIN_S:
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
        return self._result

    def _complete(self) -> None:
        global _outstanding
        self._done = True
        _outstanding -= 1
        if self._finish is not None:
            self._result = self._finish()
        self._keep = self._finish = None


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


def _start(what: str, start: Callable[..., MPI.Request], args: tuple, keep: tuple,
           finish: Callable[[], Any] | None) -> Work:
    return Work(start(*args), what, keep, finish)


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
    result = (lambda: recvbuf) if finish is None else (lambda: finish(recvbuf))
    return _start(what, comm.Iallreduce, (sendbuf, recvbuf, op), (sendbuf, recvbuf), result)


def ibcast(comm: MPI.Intracomm, buf: Any, root: int, what: str = "bcast") -> Work:
    """Start ``MPI_Ibcast`` of `buf` from `root`; the Work's result is `buf`.

    Collective over `comm`: every rank must call it.
    """
    return _start(what, comm.Ibcast, (buf, root), (buf,), lambda: buf)


def iallgather(comm: MPI.Intracomm, sendbuf: Any, recvbuf: Any, what: str = "allgather") -> Work:
    """Start ``MPI_Iallgather``; the Work's result is `recvbuf`.

    Collective over `comm`: every rank must call it.
    """
    return _start(what, comm.Iallgather, (sendbuf, recvbuf), (sendbuf, recvbuf),
                  lambda: recvbuf)



def isend(comm: MPI.Intracomm, buf: Any, dest: int, tag: int, what: str = "send") -> Work:
    """Start a point-to-point ``MPI_Isend`` of `buf` to `dest`."""
    return _start(what, comm.Isend, (buf, dest, tag), (buf,), None)


def irecv(comm: MPI.Intracomm, buf: Any, source: int, tag: int, what: str = "recv") -> Work:
    """Start a point-to-point ``MPI_Irecv`` into `buf` from `source`; the result is `buf`."""
    return _start(what, comm.Irecv, (buf, source, tag), (buf,), lambda: buf)
