"""CommJoinable: what the library's joinables share — one communicator, a deadline, a guard."""

from __future__ import annotations

import hashlib
from typing import Any, Iterable

import numpy as np
from mpi4py import MPI

from ..comm import Work, check_comm, default_comm, iallgather, resolve_timeout
from ..guard import Guard
from .join import Joinable

__all__ = ["CommJoinable"]


class CommJoinable(Joinable):
    """A Joinable bound to one communicator, whose waits share one deadline.

    Collective over `comm` the first time a communicator is used (it attaches the guard that
    carries failure notices).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm, optional
        Defaults to ``MPI.COMM_WORLD``.
    timeout : float, optional
        Seconds any wait may take before the job is aborted with
        :class:`~tensorplay_mpi.errors.CollectiveTimeoutError`; default
        ``$TENSORPLAY_MPI_TIMEOUT`` or 1800.
    device : str, default "cpu"
        The :attr:`join_device`; subclasses set :attr:`device` once they know their arrays.
    """

    def __init__(self, comm: MPI.Intracomm | None = None, timeout: float | None = None,
                 device: str = "cpu") -> None:
        super().__init__()
        self.comm = check_comm(default_comm() if comm is None else comm)
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.timeout = resolve_timeout(timeout)
        self.device = device
        self._guard = Guard.attach(self.comm)

    def _wait(self, work: Work) -> Any:
        """Wait for `work` under this joinable's deadline; return its result."""
        work.wait_or_abort(self.timeout)
        return work.result()

    def _wait_all(self, works: Iterable[Work]) -> None:
        for work in works:
            work.wait_or_abort(self.timeout)

    def _check_same_layout(self, layout: Any, what: str, mine: str) -> None:
        """Raise ``ValueError`` on every rank unless every rank passed an equal `layout`.

        Collective over ``comm``: one ``Iallgather`` of an int64 digest of ``repr(layout)``.
        `what` names the layout in the error, `mine` describes this rank's.
        """
        digest = hashlib.blake2b(repr(layout).encode(), digest_size=8).digest()
        every = np.empty(self.size, dtype=np.int64)
        self._wait(iallgather(self.comm, np.frombuffer(digest, dtype=np.int64).copy(), every,
                              f"{what} check"))
        if (every != every[0]).any():
            groups: dict[int, list[int]] = {}
            for rank, value in enumerate(every.tolist()):
                groups.setdefault(value, []).append(rank)
            raise ValueError(f"rank {self.rank}: ranks passed different {what} (ranks that "
                             f"agree: {sorted(groups.values())}); this rank has {mine}")

    @property
    def join_device(self) -> str:
        return self.device

    @property
    def join_process_group(self) -> MPI.Intracomm:
        return self.comm
