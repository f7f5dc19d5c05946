"""The settings that decide which collectives a rank starts (guard.SHAPING_SETTINGS), set on
one rank only: a ValueError on every rank when the communicator is first used, never a hang."""

import os

import numpy as np
import pytest
from toys import AllReducer

from tensorplay_mpi import DataParallel, Join, JoinableComm
from tensorplay_mpi.guard import SHAPING_SETTINGS
from tensorplay_mpi.testing import assert_all, raises_everywhere, reset_settings

# For each setting: its variable, its default, and a value other than a given one.
VARIABLES = {"debug": ("TENSORPLAY_MPI_DEBUG", "0", {"1": "0", "0": "1"}),
             "persistent": ("TENSORPLAY_MPI_PERSISTENT", "auto",
                            {"auto": "0", "0": "auto", "1": "0"})}


def test_every_shaping_setting_has_a_case():
    assert set(VARIABLES) == set(SHAPING_SETTINGS)


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
@pytest.mark.parametrize("setting", SHAPING_SETTINGS)
@pytest.mark.parametrize("first", ["JoinableComm", "DataParallel", "Join"])
def test_a_setting_on_one_rank_only_raises_on_every_rank(comm, monkeypatch, setting, first):
    variable, default, other = VARIABLES[setting]
    if comm.rank == comm.size - 1:
        monkeypatch.setenv(variable, other[os.environ.get(variable, default)])
        reset_settings()
    with raises_everywhere(ValueError, match="differ across ranks") as raised:
        _first_use(first, comm)
    listed = [f"rank {r}: " in str(raised.value) for r in range(comm.size)]
    assert_all(all(listed) and variable in str(raised.value), f"the message: {raised.value}")

    monkeypatch.undo()  # the same settings everywhere again: the communicator works
    reset_settings()
    jc = JoinableComm(comm)
    with Join([jc]):
        jc.begin_iteration()
        total = jc.allreduce(np.ones(2))
    assert_all(np.array_equal(total, np.full(2, comm.size)), f"allreduce gave {total}")
