"""Persistent collectives under JoinableComm: exact results against closed forms, more
signatures than the cache holds, the same with them off, and the setting."""

import numpy as np
import pytest
from mpi4py import MPI

from tensorplay_mpi import Join, JoinableComm, persistent
from tensorplay_mpi.errors import CollectiveMismatchError
from tensorplay_mpi.settings import settings
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
        used = jc._persistent is not None and bool(jc._persistent._cache)
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


@pytest.mark.mpi(min_size=2)
def test_a_persistent_collective_against_a_nonblocking_one_is_a_mismatch_in_debug_mode(comm):
    """Rank 0 waits on ``iallreduce`` where the others call ``allreduce`` (persistent): they
    would never match; debug mode (the plugin's) names it on every rank instead of hanging."""
    if not persistent.enabled():
        pytest.skip("no persistent collectives here (TENSORPLAY_MPI_PERSISTENT=0 or MPI < 4)")
    if not settings().debug:
        pytest.skip("TENSORPLAY_MPI_DEBUG=0 in the environment: without the check it hangs")
    jc = JoinableComm(comm)
    x = np.ones(4)
    with raises_everywhere(CollectiveMismatchError, match="persistent allreduce"):
        if comm.rank == 0:
            jc.iallreduce(x).wait()
        else:
            jc.allreduce(x)
