"""The replica check: after a failure every rank caught at the same collective count, compare
the replicated state of a Join's joinables across ranks before training goes on.

A failure agreement judges the communicator intact when every rank failed at the same count of
collectives; it cannot see local work (an optimizer step) that one rank did and another did
not before its exception.  So when a program catches such a failure and enters another Join on
that communicator, the Join first compares one 8-byte digest per rank of every joinable's
:meth:`~tensorplay_mpi.Joinable.replicated_arrays` (one ``Iallgather``) and raises on every
rank if they differ.  Without a failure nothing runs.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
from mpi4py import MPI

from .comm._digests import array_digest
from .comm._collectives import iallgather


def check_replicas(comm: MPI.Intracomm, joinables: Iterable[Any], timeout: float) -> None:
    """Raise RuntimeError on every rank unless every rank's replicated state is the same.

    Collective over `comm` (one ``Iallgather`` of an int64).
    """
    joinables = list(joinables)
    arrays = [a for j in joinables for a in j.replicated_arrays()]
    mine = np.array([array_digest(arrays)], dtype=np.int64)
    every = np.empty(comm.Get_size(), dtype=np.int64)
    iallgather(comm, mine, every, "replica check (after a caught failure)").wait_or_abort(timeout)
    if (every == every[0]).all():
        return
    groups: dict[int, list[int]] = {}
    for rank, value in enumerate(every.tolist()):
        groups.setdefault(value, []).append(rank)
    names = ", ".join(type(j).__name__ for j in joinables)
    raise RuntimeError(
        f"rank {comm.Get_rank()}: the replicas differ after a failure that every rank caught "
        f"at the same point: ranks {' / '.join(str(g) for g in groups.values())} hold different "
        f"replicated state ({names}); some rank did local work (an optimizer step, say) that "
        "another did not before its exception. Restore every rank from a checkpoint before "
        "going on")
