"""Completing what a broken communicator left pending, so that a failed job can end cleanly.

When a failure leaves a guarded communicator broken (one rank raised inside a step while
another had joined, say), the ranks stopped at different collectives: the furthest ones wait
for operations that the others will never start.  Nothing may be freed before it completes, so
without more the process would have to abort at exit.  Every rank that came to the failure
agreement therefore drains, right after it, over the guard's private ``notices``
communicator (each wait bounded by ``$TENSORPLAY_MPI_GRACE``):

1. ``Iallgather`` of how many collectives each rank started on the guarded communicator;
2. when they differ, ``Ibcast`` from the furthest rank of the descriptions of the collectives
   the others lack (kind, count, dtype, op, root: :class:`ReplayLog`);
3. each rank starts the collectives it lacks on the guarded communicator, on scratch buffers
   (zeros; a broadcast only as a receiver), then waits for every operation pending on it.

The communicator stays broken: the outputs of the operations completed this way are undefined
(they were collectives of a failed step), so their completion callbacks are dropped and waiting
for one or reading its result raises (:meth:`~tensorplay_mpi.comm.Work.void`), as every later
library collective on the communicator does.  A
drain that cannot be made exactly (an operation without a description: persistent requests,
``allgatherv``, a user-defined op, debug mode's checks; a broadcast whose root lacks it, which
would write zeros into the other ranks' arrays) is not attempted, on every rank alike: the
operations then stay pending and the process aborts at exit, saying so, as before.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

from ._ops import OPS, op_name
from ._work import Poller, Work, pending_of

LOG_LENGTH = 64
"""Collectives a guard describes, the latest ones: a drain spans fewer (a step's worth)."""

_KINDS = ("allreduce", "bcast", "allgather")  # codes 1, 2, 3; 0: cannot be replayed
_FIELDS = 5  # kind, count, dtype char, op index, root


def replay(kind: str, buf: Any, op: MPI.Op | None = None, root: int = -1) -> tuple | None:
    """What describes a collective for a lagging rank to match it (encoded only when a drain
    needs it, :meth:`ReplayLog.table`): `buf` is the receive buffer of an allreduce or
    broadcast, the send buffer of an allgather.  On every library collective: kept cheap."""
    try:
        return (kind, buf.size, buf.dtype, op, root)
    except AttributeError:
        return None


def _encode(entry: tuple | None) -> tuple:
    """An entry of the log as a row of int64 (all zeros: it cannot be replayed)."""
    if entry is None:
        return (0,) * _FIELDS
    kind, count, dtype, op, root = entry
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        return (0,) * _FIELDS
    name = "" if op is None else op_name(op)
    if name is None or dtype.kind not in "biufc" or np.dtype(dtype.char) != dtype:
        return (0,) * _FIELDS
    return (_KINDS.index(kind) + 1, int(count), ord(dtype.char),
            OPS.index(name) if name else -1, int(root))


class ReplayLog:
    """The descriptions of the latest collectives started on one communicator (None where
    one cannot be replayed), indexed by the guard's count of started collectives."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: deque[tuple | None] = deque(maxlen=LOG_LENGTH)

    def append(self, description: tuple | None) -> None:
        self._entries.append(description)

    def table(self, first: int, started: int) -> np.ndarray:
        """Rows ``[first, started)`` as ``int64[n, 5]``; kind 0 where there is no description."""
        rows = np.zeros((started - first, _FIELDS), np.int64)
        entries = list(self._entries)
        for i in range(started - first):
            at = len(entries) - (started - first) + i
            rows[i] = _encode(entries[at] if 0 <= at < len(entries) else None)
        return rows


class _GuardView(Poller, Protocol):
    """What a drain reads of :class:`~tensorplay_mpi.comm._guard.Guard`."""

    notices: MPI.Intracomm
    rank: int
    size: int
    started: int
    log: ReplayLog
    broken: str | None


def _start(comm: MPI.Intracomm, row: np.ndarray) -> tuple[MPI.Request, tuple]:
    kind, count, char, op, root = (int(v) for v in row)
    dtype = np.dtype(chr(char))
    if kind == 1:
        buf = np.zeros(count, dtype)
        return comm.Iallreduce(MPI.IN_PLACE, buf, getattr(MPI, OPS[op])), (buf,)
    if kind == 2:
        buf = np.zeros(count, dtype)
        return comm.Ibcast(buf, root), (buf,)
    send, recv = np.zeros(count, dtype), np.zeros(count * comm.Get_size(), dtype)
    return comm.Iallgather(send, recv), (send, recv)


def _within(work: Work, deadline: float) -> bool:
    return work.wait_until(max(0.0, deadline - time.monotonic()), poll=False)


def drain(guard: _GuardView, comm: MPI.Intracomm, deadline: float) -> bool:
    """Make every rank start the collectives the furthest one started, then complete every
    operation pending on `comm`; True if nothing is left pending by `deadline`.

    Collective over the guard's ``notices``: every rank that came to the failure agreement
    calls it (module docstring).
    """
    notices, rank = guard.notices, guard.rank
    counts = np.zeros(guard.size, np.int64)
    mine = np.array([guard.started], np.int64)
    if not _within(Work(notices.Iallgather(mine, counts), "drain: collectives started",
                        (mine, counts)), deadline):
        return False
    most, fewest = int(counts.max()), int(counts.min())
    replays: list[Work] = []
    if most > fewest:
        if most - fewest > LOG_LENGTH:
            return False  # the same on every rank: every rank knows the counts
        furthest = int(np.argmax(counts))
        table = guard.log.table(fewest, most) if rank == furthest else \
            np.zeros((most - fewest, _FIELDS), np.int64)
        if not _within(Work(notices.Ibcast(table, furthest), "drain: descriptions", (table,)),
                       deadline):
            return False
        for index, row in enumerate(table.tolist(), start=fewest):
            lacking = counts <= index
            if row[0] == 0 or (row[0] == 2 and lacking[row[4]]):
                return False  # decided alike everywhere: nothing is started
        for row in table[guard.started - fewest:]:
            request, keep = _start(comm, row)
            replays.append(Work(request, "drain: a collective this rank lacked", keep))
    pending = pending_of(guard)
    for work in pending:  # what they would write is meaningless: nothing may read it
        work.void(f"rank {rank}: {work.what} cannot complete: the communicator is unusable "
                  f"after {guard.broken}; end the job")
    return all([_within(work, deadline) for work in pending + replays])
