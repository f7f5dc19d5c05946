"""Persistent collectives: a loop that repeats the same small collectives pays their set-up once.

MPI-4's persistent collectives (``MPI_Allreduce_init``, ``MPI_Bcast_init``; mpi4py 4 with an
MPI-4 library such as MPICH 4 or later) are set up once and started many times.
:class:`PersistentCollectives` keeps a few of them for one communicator, each bound to buffers
of its own, by signature (kind, dtype, count, op or root): an operation copies its input into
the bound buffer, starts the request, waits, and copies the result out (for small arrays, the
copies cost less than a fresh operation's set-up).

A persistent collective matches only a persistent one, and setting one up is itself a
collective: every rank must set up and start the same ones in the same order.  So the cache is
keyed by what every rank agrees on (the signature, never a buffer's identity), its eviction
depends only on the sequence of signatures, and its users take this path on every rank or on
none: :class:`~tensorplay_mpi.algorithms.JoinableComm` for host arrays of at most
:data:`MAX_BYTES` bytes while every rank is active (or outside a Join), and for its
announcements (one request bound to the announcement buffer).

The requests are freed when their :class:`PersistentCollectives` is collected, and those
still alive at the end by :func:`free_all`: from the process's exit hook, before mpi4py's
``MPI_Finalize``, and from within an explicit ``MPI.Finalize()`` (the delete callback of an
attribute on ``COMM_SELF``, which ``MPI_Finalize`` runs first), so MPI never finds a persistent
request left at finalization (MPICH prints a line for each).

``TENSORPLAY_MPI_PERSISTENT``: ``auto`` (the default: where the library supports them), ``0``
(plain nonblocking collectives, as with Open MPI 4 or Debian's mpi4py 3) or ``1`` (a
``RuntimeError`` where they are missing).  Both paths give the same results.
"""

from __future__ import annotations

import weakref
from functools import lru_cache
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from .._resets import register
from ..settings import settings
from ._guard import Guard
from ._ops import op_name
from ._work import Work

MAX_BYTES = 4096
"""The largest array (in bytes) that goes through a persistent collective."""
_CACHED = 16  # persistent requests kept per communicator, least recently used evicted
SPINS = 8
"""Tests of a started request before it becomes a :class:`~tensorplay_mpi.comm.Work` (whose
wait yields the core between tests): a small collective between ranks on their own cores is
done within a few; an owner on an oversubscribed node passes 0."""
_live: "weakref.WeakSet[PersistentCollectives]" = weakref.WeakSet()  # freed at exit


@lru_cache(maxsize=1)
def supported() -> bool:
    """Whether mpi4py and the MPI library both have persistent collectives (MPI-4)."""
    return hasattr(MPI.Intracomm, "Allreduce_init") and MPI.Get_version() >= (4, 0)


register(supported.cache_clear)


def enabled() -> bool:
    """Whether the library uses persistent collectives (``TENSORPLAY_MPI_PERSISTENT``).

    Raises
    ------
    RuntimeError
        If the setting is ``1`` and this MPI has no persistent collectives.
    """
    mode = settings().persistent
    if mode == "0":
        return False
    if mode == "1" and not supported():
        raise RuntimeError(
            f"TENSORPLAY_MPI_PERSISTENT=1, but persistent collectives need mpi4py 4 and an "
            f"MPI-4 library; this is mpi4py with MPI {MPI.Get_version()} "
            f"({MPI.Get_library_version().splitlines()[0].strip()}): set it to auto or 0")
    return supported()


class PersistentCollectives:
    """The persistent collectives of one communicator, by signature, with their buffers.

    Every method is collective over `comm` and must be called on every rank in the same order
    with the same signature (as the collective it replaces).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm
        The communicator.
    timeout : float
        Seconds a wait may take before the job is aborted (as every library wait).
    spins : int, default :data:`SPINS`
        Tests of a started request before the wait that yields the core.
    """

    def __init__(self, comm: MPI.Intracomm, timeout: float, spins: int = SPINS) -> None:
        self.comm = comm
        self.timeout = timeout
        self._spins = spins
        self._guard = Guard.of(comm)
        self._cache: dict[tuple, tuple[MPI.Prequest, np.ndarray, np.ndarray]] = {}
        self._in_place: dict[int, tuple[MPI.Prequest, np.ndarray]] = {}
        _live.add(self)

    def __len__(self) -> int:
        """The number of persistent requests kept (one per signature used)."""
        return len(self._cache) + len(self._in_place)

    def free(self) -> None:
        """Free every kept request (all inactive: each start was waited for, and one that
        failed belongs to the registry and is no longer kept); local, not collective."""
        if not (self._cache or self._in_place) or MPI.Is_finalized():
            return
        entries = [entry[0] for entry in self._cache.values()]
        entries += [entry[0] for entry in self._in_place.values()]
        self._cache.clear()
        self._in_place.clear()
        for request in entries:
            request.Free()

    def __del__(self) -> None:
        self.free()

    def allreduce(self, x: np.ndarray, out: Any, op: MPI.Op, op_code: int, what: str) -> None:
        """Allreduce of the host array `x` into `out` (shaped and typed like `x`)."""
        self._check("allreduce", what, lambda: f"allreduce {x.size}x{x.dtype} op={op_name(op)}")
        key = (0, x.dtype, x.size, op_code)
        entry = self._cache.pop(key, None)
        if entry is None:
            send, recv = np.empty(x.size, x.dtype), np.empty(x.size, x.dtype)
            entry = (self.comm.Allreduce_init(send, recv, op), send, recv)
        request, send, recv = entry
        send[...] = x.reshape(-1)
        self._run(request, what, entry)
        self._keep(key, entry)
        out[...] = recv.reshape(x.shape)

    def bcast(self, x: np.ndarray, out: Any, root: int, what: str) -> None:
        """The `root`'s host array `x` into `out` on every rank (`x` is read on `root` only)."""
        self._check("bcast", what, lambda: f"bcast {x.size}x{x.dtype} root={root}")
        key = (1, x.dtype, x.size, root)
        entry = self._cache.pop(key, None)
        if entry is None:
            buf = np.empty(x.size, x.dtype)
            entry = (self.comm.Bcast_init(buf, root), buf, buf)
        request, buf, _ = entry
        if self.comm.Get_rank() == root:
            buf[...] = x.reshape(-1)
        self._run(request, what, entry)
        self._keep(key, entry)
        out[...] = buf.reshape(x.shape)

    def allreduce_in_place(self, buf: np.ndarray, op: MPI.Op, what: str) -> None:
        """Allreduce of `buf` in place, the request bound to `buf` itself (kept as long as this
        object: for a buffer that lives as long, such as an announcement buffer)."""
        self._check("allreduce", what, lambda: f"allreduce {buf.size}x{buf.dtype}")
        entry = self._in_place.get(id(buf))
        if entry is None or entry[1] is not buf:
            request = self.comm.Allreduce_init(MPI.IN_PLACE, buf, op)
            entry = self._in_place[id(buf)] = (request, buf)
        try:
            self._run(entry[0], what, entry)
        except BaseException:
            del self._in_place[id(buf)]  # the registry owns the request now: never restarted
            raise

    def _keep(self, key: tuple, entry: tuple) -> None:
        """Put `entry` back as the most recent; free the least recent beyond the limit."""
        self._cache[key] = entry
        if len(self._cache) > _CACHED:
            oldest = next(iter(self._cache))
            self._cache.pop(oldest)[0].Free()  # inactive: every start was waited for

    def _check(self, kind: str, what: str, signature: Callable[[], str]) -> None:
        """What every library collective asks its guard first, before anything is set up: a
        broken communicator refuses; the count of operations; debug mode's signature check
        (marked persistent: it matches no nonblocking collective of another rank)."""
        if self._guard is not None:
            self._guard.before_collective(kind, what, lambda: f"persistent {signature()}")

    def _run(self, request: MPI.Prequest, what: str, keep: tuple) -> None:
        """Start `request` and wait for it as every library collective (deadline, failure
        notices); a request that has not completed at once becomes a Work."""
        request.Start()
        try:
            for _ in range(self._spins):  # a small collective completes within a few tests
                if request.Test():
                    return
        except MPI.Exception:  # failed: the registry owns it (as below), never restarted
            Work(request, what, keep, None, self._guard)
            raise
        # on failure the registry owns it, and it is never restarted
        Work(request, what, keep, None, self._guard).wait_or_abort(self.timeout)


def free_all() -> None:
    """Free the requests of every live :class:`PersistentCollectives` (at exit, or within
    ``MPI_Finalize`` before it finalizes: :mod:`tensorplay_mpi._process`)."""
    for collectives in list(_live):
        collectives.free()
