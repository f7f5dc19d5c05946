"""BLAS and OpenMP threads: one share of the node's cores per rank, set at run time.

NumPy's BLAS starts one thread per core in every rank, so ranks sharing a node oversubscribe it
while MPI busy-polls.  At the first Join or library joinable (DataParallel, JoinableComm,
ZeroRedundancyOptimizer) on a communicator with all of COMM_WORLD's ranks (in a one-rank job, at
the first of any, optimizers included), :func:`limit_threads` limits them through threadpoolctl
(environment variables are read too late, when the libraries load) to::

    max(1, usable cores // ranks of COMM_WORLD on this node)

unless the user chose: ``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS`` or ``MKL_NUM_THREADS`` set
keeps the libraries' own choice, ``TENSORPLAY_MPI_THREADS=keep`` too, and
``TENSORPLAY_MPI_THREADS=N`` sets ``N`` threads; an optimizer, whose construction is not
collective, applies only these choices.  The automatic limit only lowers: a library already at
or below it (a ``threadpool_limits(1)`` of the user's, made before) is kept.  Rank 0 says once,
on stderr, which libraries it lowered and which it kept.  ``python -m tensorplay_mpi.info``
shows the decision.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping

from mpi4py import MPI

from ._resets import register
from .settings import settings

USER_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
"""Set by the user, any of these keeps the libraries' thread counts."""

_local_ranks: int | None = None  # ranks of COMM_WORLD on this node, once counted
_decision: str | None = None  # what was done, once done


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask), else the machine's CPU count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def choose(setting: int | str, environ: Mapping[str, str], cores: int,
           local_ranks: int | None) -> tuple[int | None, str]:
    """The thread limit (``None``: keep) and why, from the setting, the environment and the
    node's layout.

    `setting` is :attr:`Settings.threads <tensorplay_mpi.settings.Settings.threads>`
    (``"auto"``, ``"keep"`` or a number); `environ` is looked at for the BLAS libraries' own
    variables only.  `local_ranks` may be ``None`` (not counted yet); the automatic limit then
    stays undecided, returned as ``(None, "")``.
    """
    if setting == "keep":
        return None, "kept (TENSORPLAY_MPI_THREADS=keep)"
    if isinstance(setting, int):
        return setting, f"{setting} per rank (TENSORPLAY_MPI_THREADS={setting})"
    chosen = [f"{name}={environ[name]}" for name in USER_VARIABLES if name in environ]
    if chosen:
        return None, f"kept ({', '.join(chosen)} set by the user)"
    if local_ranks is None:
        return None, ""
    limit = max(1, cores // local_ranks)
    return limit, (f"{limit} per rank ({cores} usable cores // {local_ranks} ranks on this "
                   "node; TENSORPLAY_MPI_THREADS=keep or =N to choose)")


def _count_local_ranks(comm: MPI.Intracomm | None) -> int | None:
    """Ranks of COMM_WORLD on this node, when `comm` lets every rank count them now."""
    if MPI.COMM_WORLD.Get_size() == 1:
        return 1
    if comm is None or MPI.Comm.Compare(comm, MPI.COMM_WORLD) == MPI.UNEQUAL:
        return None
    # Split_type is blocking and collective over `comm`.  It runs only where every rank of
    # COMM_WORLD is in a collective call over `comm` (a joinable's constructor, Join.__enter__),
    # at the first such call, which is the same one on every rank: so it takes the same place in
    # every rank's sequence of collectives on `comm` and cannot meet a nonblocking one.  There
    # is no nonblocking MPI_Comm_split_type, and a hash of the processor name would only guess
    # which ranks share memory.
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size()
    finally:
        node.Free()


def limit_threads(comm: MPI.Intracomm | None = None, notice: bool = True,
                  setting: int | str | None = None) -> None:
    """Limit the BLAS/OpenMP threads of this process once (see the module docstring).

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm, optional
        A communicator every rank of which calls this now (collectively).  When its group is
        COMM_WORLD's, the ranks on this node are counted over it, once per process; otherwise
        (``None``: not a collective call) the automatic limit waits for such a call.
    notice : bool, default True
        Whether rank 0 prints what it changed (``info`` shows it in its report instead).
    setting : int or str, optional
        ``"auto"``, ``"keep"`` or a number of threads; default ``settings().threads``
        (``TENSORPLAY_MPI_THREADS``).

    Raises
    ------
    ValueError
        If ``TENSORPLAY_MPI_THREADS`` is neither ``keep`` nor a positive integer.
    """
    global _local_ranks, _decision
    if _local_ranks is None:
        _local_ranks = _count_local_ranks(comm)
    if _decision is not None:
        return
    if setting is None:
        setting = settings().threads
    limit, why = choose(setting, os.environ, usable_cores(), _local_ranks)
    if not why:
        return
    _decision = why
    if limit is None:
        return
    asked = isinstance(setting, int)  # then set, else only lowered
    lowered, kept = _apply(limit, lower_only=not asked)
    _decision = "; ".join([why] + [f"{verb} {', '.join(what)}" for verb, what in
                                   (("lowered", lowered), ("kept", kept)) if what])
    if notice and (kept or lowered and not asked) and MPI.COMM_WORLD.Get_rank() == 0:
        print(f"tensorplay_mpi: BLAS/OpenMP threads limited to {_decision}", file=sys.stderr,
              flush=True)


def _apply(limit: int, lower_only: bool) -> tuple[list[str], list[str]]:
    """Set every loaded BLAS/OpenMP library to `limit` threads (`lower_only`: those above it);
    what was lowered and what was kept below, as ``"openblas 8 -> 2"`` and ``"openblas at 1"``."""
    from threadpoolctl import ThreadpoolController

    lowered, kept = [], []
    for library in ThreadpoolController().lib_controllers:
        name, threads = library.internal_api, library.num_threads
        if lower_only and threads <= limit:
            if threads < limit:
                kept.append(f"{name} at {threads} (set lower before)")
            continue
        library.set_num_threads(limit)
        lowered.append(f"{name} {threads} -> {limit}")
    return lowered, kept


def oversubscribed() -> bool:
    """Whether this node runs more ranks than it has usable cores (False until
    :func:`limit_threads` has counted them): a wait should then yield the core at once."""
    return _local_ranks is not None and _local_ranks > usable_cores()


def forget_decision() -> None:
    """Forget the decision (not the limits applied): the next :func:`limit_threads` decides
    again, from the settings as they are then."""
    global _local_ranks, _decision
    _local_ranks = _decision = None


register(forget_decision)


def decision() -> str:
    """What :func:`limit_threads` did in this process, or that it has not run yet."""
    return _decision or "not decided yet (no Join or joinable made on all of COMM_WORLD)"
