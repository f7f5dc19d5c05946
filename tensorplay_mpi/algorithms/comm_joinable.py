"""CommJoinable: what the library's joinables share — one communicator, a deadline, a guard."""

from __future__ import annotations

from typing import Any, Iterable

from mpi4py import MPI

from ..comm import Work, check_comm, default_comm, resolve_timeout
from ..guard import Guard
from ..threads import limit_threads
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
        limit_threads(self.comm)

    def _wait(self, work: Work) -> Any:
        """Wait for `work` under this joinable's deadline; return its result."""
        work.wait_or_abort(self.timeout)
        return work.result()

    def _wait_all(self, works: Iterable[Work]) -> None:
        for work in works:
            work.wait_or_abort(self.timeout)

    @property
    def join_device(self) -> str:
        return self.device

    @property
    def join_process_group(self) -> MPI.Intracomm:
        return self.comm
