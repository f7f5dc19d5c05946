"""BLAS/OpenMP threads: the choice, and the limit as the ranks of a real launch see it."""

import os

import pytest

from tensorplay_mpi.testing import run_mpi
from tensorplay_mpi.settings import threads_setting
from tensorplay_mpi._threads import choose

NO_CHOICE = {"OMP_NUM_THREADS": None, "OPENBLAS_NUM_THREADS": None, "MKL_NUM_THREADS": None,
             "TENSORPLAY_MPI_THREADS": None}
PROGRAM = r"""
import numpy
from mpi4py import MPI
from threadpoolctl import threadpool_info
from tensorplay_mpi import {what}
{make}
blas = [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]
every = MPI.COMM_WORLD.gather(blas)
if MPI.COMM_WORLD.rank == 0:
    print("\n".join(f"rank {{r}} threads {{t}}" for r, t in enumerate(every)))
"""
MAKERS = {
    "DataParallel": "DataParallel([numpy.zeros(2)])",
    "JoinableComm": "JoinableComm(MPI.COMM_WORLD)",
}


@pytest.mark.parametrize("env, cores, local, expected", [
    ({}, 16, 4, 4), ({}, 2, 2, 1), ({}, 2, 4, 1), ({}, 8, 1, 8),
    ({"TENSORPLAY_MPI_THREADS": "3"}, 16, 4, 3), ({"TENSORPLAY_MPI_THREADS": "keep"}, 16, 4, None),
    ({"OMP_NUM_THREADS": "2"}, 16, 4, None), ({"MKL_NUM_THREADS": "1"}, 16, 4, None),
    ({"OPENBLAS_NUM_THREADS": "8"}, 16, 4, None),
])
def test_the_limit_is_a_share_of_the_cores_unless_the_user_chose(env, cores, local, expected):
    limit, why = choose(threads_setting(env.get("TENSORPLAY_MPI_THREADS")), env, cores, local)
    assert limit == expected and why


def test_the_automatic_limit_waits_for_the_count_of_ranks():
    assert choose("auto", {}, 16, None) == (None, "")
    assert choose(2, {"TENSORPLAY_MPI_THREADS": "2"}, 16, None)[0] == 2


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_bad_setting_is_a_value_error(value):
    with pytest.raises(ValueError, match=f"TENSORPLAY_MPI_THREADS .* got '{value}'"):
        threads_setting(value)


def run_program(nprocs, what, **env):
    code = PROGRAM.format(what=what, make=MAKERS[what])
    result = run_mpi(nprocs, ["-c", code], timeout=120, **env)
    assert result.returncode == 0, result.stdout + result.stderr
    threads = sorted(line for line in result.stdout.splitlines() if line.startswith("rank"))
    assert len(threads) == nprocs, result.stdout
    return threads, result.stderr


@pytest.mark.parametrize("what", MAKERS)
def test_two_ranks_on_this_node_share_its_cores(what):
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    threads, stderr = run_program(2, what, **NO_CHOICE)
    assert threads == [f"rank {r} threads [{share}]" for r in range(2)]
    said = stderr.count("BLAS/OpenMP threads limited to")
    assert said == (1 if share < len(os.sched_getaffinity(0)) else 0), stderr


def test_the_users_choice_is_kept():
    threads, stderr = run_program(2, "DataParallel", **dict(NO_CHOICE, OPENBLAS_NUM_THREADS="2"))
    assert threads == [f"rank {r} threads [2]" for r in range(2)]
    assert "limited" not in stderr
