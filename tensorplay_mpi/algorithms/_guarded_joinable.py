"""GuardedJoinable: what the library's joinables share — one communicator, a deadline, a guard."""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
from mpi4py import MPI

from ..comm._agreement import agree
from ..comm._digests import layout_digest
from ..comm._collectives import Work, check_comm, default_comm, iallgather, resolve_timeout
from ..comm._guard import Guard
from .._process import set_up
from .join import Joinable

def _groups(values: list[int]) -> list[list[int]]:
    """Ranks grouped by equal value, for error messages."""
    groups: dict[int, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return sorted(groups.values())


class GuardedJoinable(Joinable):
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
        self.device = device
        set_up(self.comm)  # a bad environment value raises here, before anything starts
        self._guard = Guard.attach(self.comm)  # collective first: a bad timeout on one rank
        self.timeout = resolve_timeout(timeout)

    def move_to(self, comm: MPI.Intracomm) -> None:
        """Work on `comm` from now on: the survivors' communicator after a lost rank (an
        elastic Join); collective over `comm`."""
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._guard = Guard.attach(comm)

    def _wait(self, work: Work) -> Any:
        """Wait for `work` under this joinable's deadline; return its result."""
        work.wait_or_abort(self.timeout)
        return work.result()

    def _wait_all(self, works: Iterable[Work]) -> None:
        for work in works:
            work.wait_or_abort(self.timeout)

    def _check_arguments(self, refused: Exception | None, layout: Any, what: str, mine: str,
                         **values: int | float) -> None:
        """The construction check: raise on every rank unless every rank's arguments agree.

        Collective over ``comm``: one :func:`~tensorplay_mpi.comm._agreement.agree` (an
        ``Iallgather``) of what this rank refused (`refused`, the TypeError or ValueError its
        own checks raised), a digest of `layout`, and each of `values`.  A rank that refused
        raises its own error; the others raise the same kind naming it.  Then different
        layouts (`what` names them, `mine` describes this rank's) or different `values` raise
        ``ValueError`` everywhere.
        """
        row = [0] * (1 + len(values))  # what a rank that refused sends (it raises anyway)
        if refused is None:
            row = [layout_digest(layout)]
            row += [int(np.float64(v).view(np.int64)) for v in values.values()]
        check = f"{type(self).__name__} argument check"
        every = agree(lambda mine, all_: iallgather(self.comm, mine, all_, check), self.rank,
                      self.size, check, self.timeout, refused, row, text_bytes=256).values
        if (every[:, 0] != every[0, 0]).any():
            raise ValueError(f"rank {self.rank}: ranks passed different {what} (ranks that "
                             f"agree: {_groups(every[:, 0].tolist())}); this rank has {mine}")
        for column, (name, value) in enumerate(values.items(), start=1):
            column_values = every[:, column].view(np.float64)
            if (column_values != column_values[0]).any():
                by_rank = [type(value)(v) for v in column_values.tolist()]
                raise ValueError(f"rank {self.rank}: ranks passed different {name} values "
                                 f"(by rank: {by_rank}); pass the same on every rank")

    @property
    def join_device(self) -> str:
        return self.device

    @property
    def join_process_group(self) -> MPI.Intracomm:
        return self.comm
