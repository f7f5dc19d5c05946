"""DataParallel failure paths under mpiexec, run as programs with a hard outer timeout."""

import time

import pytest
from helpers import PROGRAMS, results

from tensorplay_mpi.testing import run_mpi


@pytest.mark.parametrize("nprocs", [2, 3])
def test_every_rank_failing_with_buckets_in_flight_recovers(nprocs):
    """Issue: ranks that had started different numbers of buckets waited for each other's."""
    result = run_mpi(nprocs, [str(PROGRAMS / "dp_recovery.py")], timeout=120,
                     MPIR_CVAR_ASYNC_PROGRESS="1", TENSORPLAY_MPI_TIMEOUT="30")
    outcomes = results(result.stdout)
    assert result.returncode == 0, (result.stdout, result.stderr)
    assert outcomes == {r: "ok" for r in range(nprocs)}, (result.stdout, result.stderr)


_FIRST_WORDS = {"before": "RuntimeError: user error before", "after": "RuntimeError: user "
                "error after", "check": "RuntimeError: parameter 1 got more gradients"}


@pytest.mark.parametrize("where", sorted(_FIRST_WORDS))
@pytest.mark.parametrize("nprocs", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_an_exception_in_a_step_with_a_rank_joined_ends_the_job_normally(nprocs, where):
    """Issue: rank 0 raised inside dp.step() while a rank had joined; every rank got a clear
    error, but the joined rank waited for a collective rank 0 never started, and the library
    aborted the job at exit.  Now the ranks complete what is pending (the communicator stays
    unusable) and a program that catches its errors ends with status 0."""
    pytest.importorskip("torch")
    start = time.monotonic()
    result = run_mpi(nprocs, [str(PROGRAMS / "step_failure.py"), where], timeout=60)
    elapsed = time.monotonic() - start
    outcomes = results(result.stdout)
    context = (elapsed, result.stdout, result.stderr[-3000:])
    assert result.returncode == 0 and elapsed < 30, context
    assert "exits with" not in result.stderr and "Abort" not in result.stderr, context
    assert outcomes[0].startswith(_FIRST_WORDS[where]), context
    for rank in range(1, nprocs):
        assert outcomes[rank].startswith(
            f"PeerFailureError: rank {rank}: rank 0 failed with RuntimeError"), context
