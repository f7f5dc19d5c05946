"""Debug mode (TENSORPLAY_MPI_DEBUG) on some ranks only: its signature checks are collectives
of their own, so the first use of a communicator raises ValueError on every rank, never a hang."""

import os

import numpy as np
import pytest
from toys import AllReducer

from tensorplay_mpi import DataParallel, Join, JoinableComm
from tensorplay_mpi.testing import assert_all, raises_everywhere, reset_settings


def _first_use(kind, comm):
    """Use `comm` for the first time as `kind` does (each attaches the communicator's guard)."""
    if kind == "JoinableComm":
        JoinableComm(comm)
    elif kind == "DataParallel":
        DataParallel([np.zeros(3)], comm=comm)
    else:
        with Join([AllReducer(comm)]):
            pass


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("first", ["JoinableComm", "DataParallel", "Join"])
def test_debug_mode_on_one_rank_only_raises_on_every_rank(comm, monkeypatch, first):
    on = os.environ.get("TENSORPLAY_MPI_DEBUG", "0") in ("1", "true", "yes", "on")
    last = comm.size - 1
    if comm.rank == last:
        monkeypatch.setenv("TENSORPLAY_MPI_DEBUG", "0" if on else "1")
        reset_settings()
    with raises_everywhere(ValueError, match="TENSORPLAY_MPI_DEBUG is on for ranks") as raised:
        _first_use(first, comm)
    sides = f"on for ranks {last} and off" if not on else f"and off for ranks {last};"
    assert_all(sides in str(raised.value), f"the message: {raised.value}")

    monkeypatch.undo()  # the same setting everywhere again: the communicator works
    reset_settings()
    jc = JoinableComm(comm)
    with Join([jc]):
        jc.begin_iteration()
        total = jc.allreduce(np.ones(2))
    assert_all(np.array_equal(total, np.full(2, comm.size)), f"allreduce gave {total}")


@pytest.mark.mpi(min_size=2)
def test_the_message_names_world_ranks_on_a_sub_communicator(comm, monkeypatch):
    sub = comm.Split(0, -comm.rank)  # the ranks in reverse: sub rank r is world rank size-1-r
    if comm.rank == 0:
        monkeypatch.setenv("TENSORPLAY_MPI_DEBUG", "0")
        reset_settings()
    try:
        with raises_everywhere(ValueError, match="TENSORPLAY_MPI_DEBUG") as raised:
            JoinableComm(sub)
    finally:
        sub.Free()
    last = comm.size - 1
    assert_all(f"off for ranks {last} (world rank 0);" in str(raised.value),
               f"the message: {raised.value}")
