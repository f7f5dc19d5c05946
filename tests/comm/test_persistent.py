"""Persistent collectives under JoinableComm: exact results against closed forms, more
signatures than the cache holds, the same with them off, and the setting."""

import numpy as np
import pytest
from helpers import HostSubclass
from mpi4py import MPI

from tensorplay_mpi import DataParallel, Join, JoinableComm
from tensorplay_mpi.comm import _persistent as persistent
from tensorplay_mpi.errors import CollectiveMismatchError
from tensorplay_mpi.testing import assert_all, inputs_of, raises_everywhere, reset_settings


def _iteration(jc, rank, t, active):
    """Small allreduces (more signatures than the cache keeps), a MAX and a broadcast, in
    iteration `t` with the ranks `active`; the first error against the closed form, or None."""
    for n in range(1, 2 * persistent._CACHED + 3):  # each count is a new signature
        got = jc.allreduce(np.arange(n, dtype=np.float64) + rank + t)
        expected = sum(np.arange(n) + r + t for r in active)
        if not np.array_equal(got, expected):
            return f"iteration {t}, sum of {n}: {got} != {expected}"
    top = jc.allreduce(np.array([rank * 10 + t], np.int64), MPI.MAX)
    if top[0] != max(active) * 10 + t:
        return f"iteration {t}: max {top}"
    out = np.empty(3, np.int32)
    got = jc.bcast(np.full(3, rank + t, np.int32), root="highest_active", out=out)
    if got is not out or not (out == max(active) + t).all():
        return f"iteration {t}: bcast {out}"
    return None


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", ["even", "three_plus_rank", "rank0_zero"])
@pytest.mark.parametrize("mode", ["auto", "0"])
def test_small_operations_are_exact_with_and_without_persistent_collectives(
        comm, pattern, mode, monkeypatch):
    monkeypatch.setenv("TENSORPLAY_MPI_PERSISTENT", mode)
    reset_settings()
    try:
        jc = JoinableComm(comm)
        inputs = inputs_of(pattern, comm.size)
        errors = []
        with Join([jc]):
            for t in range(inputs[comm.rank]):
                jc.begin_iteration()
                active = [r for r in range(comm.size) if inputs[r] > t]
                errors.append(_iteration(jc, comm.rank, t, active))
        for t in range(2):  # outside a Join: every rank
            errors.append(_iteration(jc, comm.rank, t, list(range(comm.size))))
        used = jc.persistent is not None and len(jc.persistent) > 0
    finally:
        reset_settings()
    errors = [e for e in errors if e]
    expect_used = mode == "auto" and persistent.supported()
    assert_all(not errors and used == expect_used,
               f"{errors[:1]}; persistent collectives used: {used}, expected {expect_used}")


@pytest.mark.mpi
def test_persistent_one_where_unsupported_is_refused_everywhere(comm, monkeypatch):
    monkeypatch.setenv("TENSORPLAY_MPI_PERSISTENT", "1")
    monkeypatch.setattr(persistent, "supported", lambda: False)
    reset_settings()
    try:
        with raises_everywhere(RuntimeError, match="TENSORPLAY_MPI_PERSISTENT=1"):
            JoinableComm(comm)
    finally:
        reset_settings()


def _skip_without_persistent_collectives():
    if not persistent.supported():
        pytest.skip("this MPI has no persistent collectives (MPI < 4 or mpi4py < 4)")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("first", ["JoinableComm", "DataParallel"])
def test_persistent_on_some_ranks_only_raises_on_every_rank_where_it_matters(
        comm, monkeypatch, first):
    _skip_without_persistent_collectives()
    other = "0" if persistent.enabled() else "auto"
    last = comm.size - 1
    if comm.rank == last:
        monkeypatch.setenv("TENSORPLAY_MPI_PERSISTENT", other)
        reset_settings()
    if first == "DataParallel":  # it has no persistent collective: nothing to refuse
        DataParallel([np.zeros(2)], comm=comm)
        return
    with raises_everywhere(ValueError, match="TENSORPLAY_MPI_PERSISTENT is on for ranks") as raised:
        JoinableComm(comm)
    side = "off" if other == "0" else "on"
    assert_all(f"{side} for ranks {last}" in str(raised.value), f"the message: {raised.value}")


@pytest.mark.mpi(min_size=2)
def test_auto_and_1_on_different_ranks_agree_where_both_mean_on(comm, monkeypatch):
    _skip_without_persistent_collectives()
    monkeypatch.setenv("TENSORPLAY_MPI_PERSISTENT", "1" if comm.rank == 0 else "auto")
    reset_settings()
    jc = JoinableComm(comm)
    total = jc.allreduce(np.arange(3.0))
    assert_all(np.array_equal(total, np.arange(3.0) * comm.size), f"allreduce gave {total}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["allreduce", "bcast"])
def test_an_ndarray_subclass_on_one_rank_takes_the_same_path(comm, op):
    """Rank 0's array is an ndarray subclass, the others' plain, every rank active (the
    persistent path) and then the last rank joined (the announcements): the same collective
    on every rank (debug mode, the plugin's, would name a mismatch), exact."""
    jc = JoinableComm(comm)
    errors = []
    with Join([jc]):
        for t in range(1 if comm.rank == comm.size - 1 else 2):
            jc.begin_iteration()
            active = range(comm.size if t == 0 else comm.size - 1)
            x = np.full(3, comm.rank + 1.0 + t)
            if comm.rank == 0:
                x = x.view(HostSubclass)
            if op == "allreduce":
                got, expected = jc.allreduce(x, MPI.MAX), np.full(3, max(active) + 1.0 + t)
            else:
                got, expected = jc.bcast(x, root=0), np.full(3, 1.0 + t)
            if not np.array_equal(np.asarray(got), expected):
                errors.append(f"iteration {t}: {op} gave {got}, expected {expected}")
    assert_all(not errors, "; ".join(errors))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["allreduce", "bcast"])
def test_a_persistent_collective_against_a_nonblocking_one_is_a_mismatch(comm, op):
    """Rank 0 waits on the i-variant where the others call the blocking method (persistent):
    they would never match; the announcement names it on every rank instead, by default."""
    if not persistent.enabled():
        pytest.skip("no persistent collectives here (TENSORPLAY_MPI_PERSISTENT=0 or MPI < 4)")
    jc = JoinableComm(comm)
    x = np.ones(40)  # 320 bytes: too large for the announcement to carry (a bcast or a SUM)
    with raises_everywhere(CollectiveMismatchError, match="allreduce against iallreduce"):
        if comm.rank == 0:
            (jc.iallreduce(x) if op == "allreduce" else jc.ibcast(x, root=0)).wait()
        else:
            jc.allreduce(x) if op == "allreduce" else jc.bcast(x, root=0)
