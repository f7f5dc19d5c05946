"""DataParallel failure paths under mpiexec, run as programs with a hard outer timeout."""

from pathlib import Path

import pytest
from helpers import results

from tensorplay_mpi.testing import run_mpi

PROGRAMS = Path(__file__).parent / "programs"


@pytest.mark.parametrize("nprocs", [2, 3])
def test_every_rank_failing_with_buckets_in_flight_recovers(nprocs):
    """Issue: ranks that had started different numbers of buckets waited for each other's."""
    result = run_mpi(nprocs, [str(PROGRAMS / "dp_recovery.py")], timeout=120,
                     MPIR_CVAR_ASYNC_PROGRESS="1", TENSORPLAY_MPI_TIMEOUT="30")
    outcomes = results(result.stdout)
    assert result.returncode == 0, (result.stdout, result.stderr)
    assert outcomes == {r: "ok" for r in range(nprocs)}, (result.stdout, result.stderr)
