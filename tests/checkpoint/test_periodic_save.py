"""A periodic save done wrong, launched under mpiexec: errors on every rank, never a hang, and
the previous checkpoint whole (the in-process cases are in test_periodic_save_mpi.py)."""

import os
import re

import numpy as np
import pytest
from helpers import PROGRAMS

from tensorplay_mpi import checkpoint
from tensorplay_mpi.testing import run_mpi

MISUSE = str(PROGRAMS / "misuse.py")


@pytest.mark.parametrize("nprocs", [2, 3])
def test_a_save_inside_a_join_with_a_joined_rank_fails_on_every_rank(tmp_path, nprocs):
    directory = str(tmp_path)
    checkpoint.save(directory, [np.arange(4.0)])  # the previous checkpoint (one rank)
    before = (tmp_path / checkpoint.MANIFEST).read_bytes()
    result = run_mpi(nprocs, [MISUSE, "save_inside", directory], timeout=90,
                     TENSORPLAY_MPI_GRACE="3")
    outcomes = dict(re.findall(r"RESULT rank=(\d+) (.*?)(?=RESULT rank=|$)", result.stdout,
                               re.M))
    assert result.returncode != 0 and len(outcomes) == nprocs, (result.stdout, result.stderr)
    assert outcomes["0"].startswith("PeerFailureError: rank 0: rank "), outcomes
    for rank in range(1, nprocs):
        assert outcomes[str(rank)].startswith(f"RuntimeError: rank {rank}: checkpoint.save was "
                                              "called inside a running Join"), outcomes
    assert (tmp_path / checkpoint.MANIFEST).read_bytes() == before
    assert sorted(os.listdir(directory)) == [checkpoint.MANIFEST]
