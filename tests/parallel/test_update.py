"""An exception inside ``DataParallel(..., update=fn)`` on one rank ends every rank, fast.

tests/programs/update_failure.py makes rank 0 raise in its update while active, or while
joined (in its shadow of a step); under mpiexec with a hard timeout, rank 0 reports its own
ValueError and every other rank a PeerFailureError naming it, never a hang.
"""

import re
import time

import pytest
from helpers import PROGRAMS

from tensorplay_mpi.testing import run_mpi

pytest.importorskip("torch")

PROGRAM = str(PROGRAMS / "update_failure.py")


@pytest.mark.parametrize("where", ["active", "joined"])
@pytest.mark.parametrize("nprocs", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_an_exception_in_update_raises_on_every_rank(nprocs, where):
    start = time.monotonic()
    result = run_mpi(nprocs, [PROGRAM, where], timeout=60)
    elapsed = time.monotonic() - start
    outcomes = dict(re.findall(r"RESULT rank=(\d+) (.*)", result.stdout))
    context = (elapsed, result.stdout, result.stderr[-3000:])
    assert result.returncode != 0 and elapsed < 30, context
    assert outcomes.get("0") == f"ValueError: update failed on purpose ({where})", context
    for rank in range(1, nprocs):
        assert outcomes.get(str(rank), "").startswith(
            f"PeerFailureError: rank {rank}: rank 0 failed with ValueError"), context
