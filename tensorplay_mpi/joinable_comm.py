"""JoinableComm: any iterative MPI loop made join-safe without writing a hook.

Wire schedule.  ``begin_iteration()`` reads the heartbeat's count ``n`` of active ranks.

- ``n == size`` (every rank active): each operation goes straight to MPI, nothing more:
  ``allreduce`` is one ``Iallreduce``; ``bcast`` one ``Ibcast``; ``allgather`` an
  ``Iallgather`` of the row counts, then an ``Iallgatherv``.
- ``n < size``: before each operation the active ranks announce it with
  ``Iallreduce(int64[16], MAX)`` of ``[kind, op, dtype, ndim, root, rank == root, rank,
  shape...]``; joined ranks send the int64 minimum, so every rank learns the operation, the
  highest active rank and whether an int root is active.  Then the operation runs, joined ranks
  contributing the identity of the op, zero rows, or only receiving.  The iteration ends with an
  announcement of kind END, sent before the next heartbeat or when the rank joins.  A joined
  rank's hook follows the announcements until END, so it needs no recording of the past: a rank
  with zero iterations, or a loop whose collectives change, works.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from .algorithms.comm_joinable import CommJoinable
from .algorithms.join import Join, JoinHook
from .buffers import device_of, zeros_like
from .comm import OPS, Work, iallgather, iallgatherv, iallreduce, ibcast, op_name

__all__ = ["JoinableComm"]

_END, _ALLREDUCE, _ALLGATHER, _BCAST = 1, 2, 3, 4
_DTYPES = tuple(np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128))
_SLOTS, _SHAPE_AT = 16, 7  # announcement length; where the shape starts in it
_MAX_NDIM = _SLOTS - _SHAPE_AT
_NOBODY = np.iinfo(np.int64).min  # what a joined rank announces


def identity(op: MPI.Op, dtype: Any) -> Any:
    """The element that leaves `op` unchanged, for `dtype` (what a joined rank contributes).

    Raises
    ------
    ValueError
        For an op without an identity here (user-defined ops, MAXLOC, ...).
    """
    dtype = np.dtype(dtype)
    name = _op_name(op)
    if name in ("SUM", "LOR", "LXOR", "BOR", "BXOR"):
        return dtype.type(0)
    if name in ("PROD", "LAND"):
        return dtype.type(1)
    if name == "BAND":
        return dtype.type(True) if dtype.kind == "b" else ~dtype.type(0)
    lowest = name == "MAX"
    if dtype.kind == "b":
        return dtype.type(not lowest)
    if dtype.kind == "f":
        return dtype.type(-np.inf if lowest else np.inf)
    info = np.iinfo(dtype)
    return dtype.type(info.min if lowest else info.max)


def _op_name(op: MPI.Op) -> str:
    name = op_name(op)
    if name is None:
        raise ValueError(f"JoinableComm supports the ops {', '.join(OPS)}; got {op!r}")
    return name


def _dtype_code(dtype: Any) -> int:
    try:
        return _DTYPES.index(np.dtype(dtype)) + 1
    except ValueError:
        raise TypeError(f"JoinableComm cannot send dtype {dtype}") from None


class JoinableComm(CommJoinable):
    """A Joinable wrapping a communicator: its collectives are shadowed automatically.

    Results on active ranks are exactly what they would be if the joined ranks did not exist.
    Collective over `comm`: every active rank calls :meth:`begin_iteration` once per iteration,
    then the same operations in the same order.  Beside other joinables (``Join([dp, jc])``)
    call it after theirs, in list order: the first joinable's heartbeat starts the iteration.

    Parameters
    ----------
    comm, timeout
        As for :class:`~tensorplay_mpi.algorithms.comm_joinable.CommJoinable`.

    Examples
    --------
    ::

        jc = JoinableComm(comm)
        with Join([jc]):                      # or Join([dp, jc])
            for chunk in my_chunks:
                jc.begin_iteration()
                total = jc.allreduce(chunk.sum(axis=0))
                rows = jc.allgather(chunk[:2])
                w = jc.bcast(weights, root="highest_active")
    """

    def __init__(self, comm: MPI.Intracomm | None = None, timeout: float | None = None) -> None:
        super().__init__(comm, timeout)  # device: of the last array seen (joined ranks: host)
        self._announcement = np.empty(_SLOTS, np.int64)
        self._announcing = False  # this iteration has joined ranks: announce every operation
        self._owner: Join | None = None  # the Join of the current iteration
        self._works: list[Work] = []  # this iteration's operations, completed at its end
        self._begun = False
        self._iteration = 0

    # -- iterations ------------------------------------------------------------------------

    def begin_iteration(self) -> None:
        """Start an iteration: the heartbeat when this is the first joinable, then the mode.

        Collective over ``comm``.
        """
        heartbeat = Join.notify_join_context(self)
        self._iteration += 1
        if heartbeat is not None:
            heartbeat.wait_or_abort(self.timeout)
            active = heartbeat.result()
        elif self.join_context is not None:
            active = self.join_context.active_ranks()
        else:
            active = self.size
        self._announcing = active < self.size
        self._owner = self.join_context
        self._begun = True

    def end_iteration(self) -> None:
        """Complete this iteration's dropped Works; announce END when ranks have joined."""
        join = self.join_context
        if join is not None and join is self._owner:  # not after an exception
            for work in self._works:  # i-variants' Works that their caller dropped
                work.wait_or_abort(self.timeout)
            if self._announcing:
                self._announce(_END)
        self._works.clear()
        self._announcing = self._begun = False

    def _own(self, work: Work) -> Work:
        self._works.append(work)
        return work

    def _check_begun(self) -> None:
        join = self.join_context
        if not self._begun and join is not None and join.enabled:
            raise RuntimeError("call jc.begin_iteration() at the start of every iteration "
                               "inside a Join, before its first operation")

    def _announce(self, kind: int, op: int = 0, dtype: int = 0, shape: tuple = (),
                  root: int = -1) -> np.ndarray:
        if len(shape) > _MAX_NDIM:
            raise ValueError(f"JoinableComm supports up to {_MAX_NDIM} dimensions, got "
                             f"{len(shape)}")
        a = self._announcement
        a[:] = 0
        a[:_SHAPE_AT] = (kind, op, dtype, len(shape), root, int(self.rank == root), self.rank)
        a[_SHAPE_AT:_SHAPE_AT + len(shape)] = shape
        self._exchange_announcement(f"announcement of iteration {self._iteration}")
        return a

    def _exchange_announcement(self, what: str) -> None:
        iallreduce(self.comm, MPI.IN_PLACE, self._announcement, MPI.MAX, what).wait_or_abort(
            self.timeout)

    # -- operations ------------------------------------------------------------------------

    def iallreduce(self, x: Any, op: MPI.Op = MPI.SUM, out: Any = None) -> Work:
        """Start an allreduce of `x` over the active ranks; the Work's result is `out`.

        Joined ranks contribute the identity of `op` (0 for SUM, 1 for PROD, the lowest value
        for MAX, ...).  `out` (shaped and typed like `x`) receives the result; by default a new
        array (passing one saves an allocation per call, which costs more than the allreduce
        for large arrays).  A Work of an iteration that its caller drops is completed by the
        library when the iteration ends (inside a Join).
        """
        self._check_begun()
        x = self._array(x)
        out = _output(x, out)
        if self._announcing:
            self._announce(_ALLREDUCE, OPS.index(_op_name(op)) + 1, _dtype_code(x.dtype),
                           x.shape)
        return self._own(iallreduce(self.comm, x, out, op, f"allreduce ({self._where()})"))

    def allreduce(self, x: Any, op: MPI.Op = MPI.SUM, out: Any = None) -> Any:
        """Allreduce of `x` over the active ranks (see :meth:`iallreduce`)."""
        return self._wait(self.iallreduce(x, op, out))

    def iallgather(self, rows: Any) -> Work:
        """Start a gather of every active rank's rows, in rank order; the result is an array.

        `rows` has shape ``(r, ...)``; ``r`` may differ per rank, the rest may not.  The row
        counts are exchanged (and waited for) first; the Work is the data's allgatherv.
        """
        self._check_begun()
        rows = self._array(rows)
        if rows.ndim < 1:
            raise ValueError("allgather needs rows of at least one dimension")
        if self._announcing:
            self._announce(_ALLGATHER, 0, _dtype_code(rows.dtype), rows.shape)
        return self._own(self._gather_rows(rows, rows.shape[0]))

    def allgather(self, rows: Any) -> Any:
        """The active ranks' rows, concatenated in rank order (see :meth:`iallgather`)."""
        return self._wait(self.iallgather(rows))

    def _gather_rows(self, rows: Any, count: int) -> Work:
        mine = np.array([count], np.int64)
        counts = np.empty(self.size, np.int64)
        self._wait(iallgather(self.comm, mine, counts, f"row counts ({self._where()})"))
        row_size = int(np.prod(rows.shape[1:], dtype=np.int64))
        out = zeros_like(rows, int(counts.sum()) * row_size).reshape(
            (int(counts.sum()),) + tuple(rows.shape[1:]))
        return iallgatherv(self.comm, rows, out, (counts * row_size).tolist(),
                           f"allgather ({self._where()})")

    def ibcast(self, x: Any, root: int | str = "highest_active", out: Any = None) -> Work:
        """Start a broadcast from `root`; the Work's result is `out` (the root's data).

        `root` is an active rank, or ``"highest_active"``.  An int root that has joined (or is
        no rank) raises ``ValueError`` on every rank, joined ones included.  `out` (shaped and
        typed like `x`) receives the data; by default a new array.
        """
        self._check_begun()
        x = self._array(x)
        out = _output(x, out)
        highest = root == "highest_active"
        if not highest and not isinstance(root, (int, np.integer)):
            raise TypeError(f"root must be an int or 'highest_active', got {root!r}")
        target = -1 if highest else int(root)
        if self._announcing:
            a = self._announce(_BCAST, 0, _dtype_code(x.dtype), x.shape, target)
            target = int(a[6]) if highest else target
            _check_root(target, bool(a[5]) or highest)
        elif highest:
            target = self.size - 1
        else:
            _check_root(target, 0 <= target < self.size)
        if self.rank == target:
            out[...] = x
        return self._own(ibcast(self.comm, out, target, f"bcast from {target} ({self._where()})"))

    def bcast(self, x: Any, root: int | str = "highest_active", out: Any = None) -> Any:
        """The root's `x` on every active rank (see :meth:`ibcast`)."""
        return self._wait(self.ibcast(x, root, out))

    def _array(self, x: Any) -> Any:
        if type(x) is np.ndarray:
            return x
        if not hasattr(x, "dtype") or not hasattr(x, "shape"):
            return np.asarray(x)
        self.device = device_of(x)
        return x

    def _where(self) -> str:
        return f"iteration {self._iteration}"

    # -- Joinable ------------------------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _FollowAnnouncements(self)


def _output(x: Any, out: Any) -> Any:
    if out is None:
        return zeros_like(x)
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out must be shaped and typed like the input: {x.shape} {x.dtype}, "
                         f"got {out.shape} {out.dtype}")
    return out


def _check_root(root: int, active: bool) -> None:
    if not active:
        raise ValueError(f"bcast root {root} is not an active rank (it has joined, or is no "
                         "rank); use an active rank or root='highest_active'")


class _FollowAnnouncements(JoinHook):
    _CACHED = 8  # shadow buffers kept, for the most recent operations' shapes

    def __init__(self, jc: JoinableComm) -> None:
        self.jc = jc
        self._buffers: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def _shadow_buffers(self, op: int, shape: tuple, dtype: np.dtype) -> tuple:
        """A joined rank's contribution and receive buffer, made once per op, shape and dtype."""
        key = (op, shape, dtype)
        buffers = self._buffers.pop(key, None)
        if buffers is None:
            fill = identity(getattr(MPI, OPS[op - 1]), dtype) if op else 0
            buffers = np.full(shape, fill, dtype), np.empty(shape, dtype)
        self._buffers[key] = buffers  # most recent last
        if len(self._buffers) > self._CACHED:
            del self._buffers[next(iter(self._buffers))]
        return buffers

    def main_hook(self) -> None:
        """Shadow one active iteration: follow the announcements until END."""
        jc = self.jc
        jc._iteration += 1
        while True:
            jc._announcement[:] = _NOBODY
            jc._exchange_announcement(f"announcement of iteration {jc._iteration} (joined)")
            kind, op, code, ndim, root, root_active, highest = jc._announcement[:_SHAPE_AT]
            if kind == _END:
                return
            shape = tuple(int(n) for n in jc._announcement[_SHAPE_AT:_SHAPE_AT + ndim])
            dtype = _DTYPES[code - 1]
            if kind == _ALLREDUCE:
                contribution, received = self._shadow_buffers(op, shape, dtype)
                jc._wait(iallreduce(jc.comm, contribution, received, getattr(MPI, OPS[op - 1]),
                                    f"allreduce ({jc._where()}, joined)"))
            elif kind == _ALLGATHER:
                jc._wait(jc._gather_rows(np.empty((0,) + shape[1:], dtype), 0))
            else:
                target = int(highest) if root == -1 else int(root)
                _check_root(target, bool(root_active) or root == -1)
                jc._wait(ibcast(jc.comm, self._shadow_buffers(0, shape, dtype)[1], target,
                                f"bcast from {target} ({jc._where()}, joined)"))
