"""The collective wrappers: the single start-then-wait path of every library collective.

MPI matches collectives per communicator in start order, and a blocking collective never matches
a nonblocking one.  Every collective that tensorplay_mpi issues, and every shadow a join hook
issues, therefore starts a nonblocking operation here and completes it through a
:class:`~tensorplay_mpi.comm.Work`.  Custom joinables should use these functions too (never
``comm.Allreduce`` and friends), so that a joined rank's shadow always matches what an active
rank issued.

Buffers are NumPy or CuPy arrays, torch tensors (CPU or CUDA) or objects exporting
``__dlpack__`` on the CPU; the last two go to MPI as NumPy (CuPy) views of their memory, without
copies.

On a guarded communicator (one used by a Join or a library joinable) each start asks the
:class:`~tensorplay_mpi.comm._guard.Guard` first (a broken communicator refuses; debug mode checks
signatures), and each wait polls it for failure notices of other ranks.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..settings import positive_seconds, settings
from ._buffers import Staging, copy_into, misordered
from ._drain import replay
from ._guard import Guard
from ._ops import op_name
from ._tensors import as_array, is_tensor
from ._work import Work

_HOST = Staging()  # host arrays only: nothing to stage, nothing to copy back (never changes)


def default_timeout() -> float:
    """Seconds a library wait may take: ``$TENSORPLAY_MPI_TIMEOUT``, default 1800.

    Raises
    ------
    ValueError
        If the variable is set to something that is not a positive number.
    """
    return settings().timeout


def resolve_timeout(timeout: float | None) -> float:
    """`timeout` checked to be a positive, finite number, or :func:`default_timeout` for None.

    Raises
    ------
    TypeError, ValueError
        If `timeout` is not a number, or not positive and finite.
    """
    return default_timeout() if timeout is None else positive_seconds(timeout, "timeout")


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


def _buffer(buf: Any, name: str, what: str) -> Any:
    """`buf` as MPI takes it: arrays as they are, torch tensors and CPU DLPack exporters as
    NumPy (CuPy) views of their memory (no copy).  Refuse what MPI would misread: a non-array, or
    an array not in C order (MPI reads and writes memory in order: a Fortran-ordered array
    would be scrambled, a strided one refused only after other ranks have started the
    operation)."""
    if type(buf) is np.ndarray and buf.flags.c_contiguous or buf is MPI.IN_PLACE:
        return buf  # the common case, without look-ups
    given, buf = buf, as_array(buf, f"{what}: {name}")
    if not hasattr(buf, "__array_interface__") and not hasattr(buf, "__cuda_array_interface__") \
            and not isinstance(buf, memoryview):
        raise TypeError(f"{what}: {name} must be an array (NumPy, CuPy, a torch tensor or "
                        f"a CPU DLPack exporter), got {type(buf).__name__}; convert it with "
                        "numpy.asarray")
    layout = misordered(buf)
    if layout is not None:
        remedy = ("t.contiguous() (and copy a received result back with t.copy_(result))"
                  if is_tensor(given) else
                  "numpy.ascontiguousarray of it (and copy a received result back)")
        raise ValueError(f"rank {MPI.COMM_WORLD.Get_rank()}: {what}: {name} must be "
                         f"C-contiguous, got a {layout} array; pass {remedy}")
    return buf


def _start(comm: MPI.Comm, what: str, kind: str, start: Callable[..., MPI.Request],
           args: tuple, keep: tuple, value: Any, staging: Staging,
           signature: Callable[[], str] | None = None,
           finish: Callable[[Any], Any] | None = None,
           description: tuple = ("", None)) -> Work:
    """The one place where every library operation starts.

    The Work's result is `value`, or ``finish(value)``; staged buffers are copied back first.
    Host buffers (nothing staged, no `finish`) need no completion callback at all.
    `description` is ``(kind, buffer[, op, root])`` for :func:`~tensorplay_mpi.comm._drain.replay`:
    what a lagging rank would start to match it after a failure.
    """
    settings()  # a bad environment value raises here, before the operation starts
    guard = Guard.of(comm)
    if guard is not None:
        guard.before_collective(kind, what, signature, replay(*description))
    if not staging.copies_back and finish is None:
        return Work(start(*args), what, keep + staging.hosts, None, guard, value)

    def complete() -> Any:
        staging.finish()
        return value if finish is None else finish(value)

    return Work(start(*args), what, keep + staging.hosts, complete, guard)


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
    Always in place: a separate `sendbuf` is first copied into `recvbuf`.  Open MPI 5.0's
    nonblocking allreduce (libnbc) gave ``MPI_ERR_TRUNCATE`` on one rank and a wrong sum on
    another here when some ranks passed ``MPI_IN_PLACE`` and others a send buffer (legal
    MPI; 4 ranks, 15,000 doubles), as a joined rank's zeros beside active ranks' in-place
    gradients would.
    """
    send, recv = _buffer(sendbuf, "sendbuf", what), _buffer(recvbuf, "recvbuf", what)
    if send is not MPI.IN_PLACE:
        copy_into(recv, send)
    if type(recv) is np.ndarray:
        staging, args = _HOST, (MPI.IN_PLACE, recv, op)  # a host array: no staging to decide
    else:
        staging = Staging()
        args = (MPI.IN_PLACE, staging.update(recv), op)
    return _start(comm, what, "allreduce", comm.Iallreduce, args, (recv,), recvbuf,
                  staging,
                  lambda: f"allreduce {_describe(recv)} op={op_name(op) or 'user-defined'}",
                  finish, ("allreduce", recv, op))


def ibcast(comm: MPI.Intracomm, buf: Any, root: int, what: str = "bcast") -> Work:
    """Start ``MPI_Ibcast`` of `buf` from `root`; the Work's result is `buf`.

    Collective over `comm`: every rank must call it.
    """
    data = _buffer(buf, "buf", what)
    if type(data) is np.ndarray:
        staging, mpi_buf = _HOST, data  # a host array: no staging to decide
    else:
        staging = Staging()
        mpi_buf = staging.read(data) if comm.Get_rank() == root else staging.write(data)
    return _start(comm, what, "bcast", comm.Ibcast, (mpi_buf, root), (data,), buf,
                  staging, lambda: f"bcast {_describe(data)} root={root}",
                  description=("bcast", data, None, root))


def iallgather(comm: MPI.Intracomm, sendbuf: Any, recvbuf: Any, what: str = "allgather") -> Work:
    """Start ``MPI_Iallgather``; the Work's result is `recvbuf`.

    Collective over `comm`: every rank must call it.
    """
    send, recv = _buffer(sendbuf, "sendbuf", what), _buffer(recvbuf, "recvbuf", what)
    staging = Staging()
    args = (staging.read(send), staging.write(recv))
    return _start(comm, what, "allgather", comm.Iallgather, args, (send, recv),
                  recvbuf, staging, lambda: f"allgather {_describe(send)}",
                  description=("allgather", send))


def iallgatherv(comm: MPI.Intracomm, sendbuf: Any, recvbuf: Any, counts: list[int],
                what: str = "allgatherv") -> Work:
    """Start ``MPI_Iallgatherv``: rank ``r`` sends ``counts[r]`` elements, gathered in rank order.

    Collective over `comm`: every rank must call it with the same `counts`.
    """
    send, recv = _buffer(sendbuf, "sendbuf", what), _buffer(recvbuf, "recvbuf", what)
    staging = Staging()
    args = (staging.read(send), [staging.write(recv), counts])
    return _start(comm, what, "allgather", comm.Iallgatherv, args, (send, recv),
                  recvbuf, staging, lambda: f"allgatherv {_describe(recv)}")


def isend(comm: MPI.Intracomm, buf: Any, dest: int, tag: int, what: str = "send") -> Work:
    """Start a point-to-point ``MPI_Isend`` of `buf` to `dest`."""
    data = _buffer(buf, "buf", what)
    staging = Staging()
    return _start(comm, what, "send", comm.Isend, (staging.read(data), dest, tag), (data,), None,
                  staging)


def irecv(comm: MPI.Intracomm, buf: Any, source: int, tag: int, what: str = "recv") -> Work:
    """Start a point-to-point ``MPI_Irecv`` into `buf` from `source`; the result is `buf`."""
    data = _buffer(buf, "buf", what)
    staging = Staging()
    return _start(comm, what, "recv", comm.Irecv, (staging.write(data), source, tag), (data,),
                  buf, staging)
