"""The misuse paths that used to be silent or wrong: serial checks, and whole programs under
mpiexec where the output of every rank is the verdict."""

import os
import pickle

import numpy as np
import pytest
from helpers import results
from mpi4py import MPI

from tensorplay_mpi import SGD, Adam, AdamW
from tensorplay_mpi.comm import iallgather, iallreduce, ibcast, irecv, isend
from tensorplay_mpi.optim import clip_grad_norm
from tensorplay_mpi.testing import run_mpi

# -- clipping float32 --------------------------------------------------------------------------


def test_clipping_float32_gradients_of_1e20_is_exact():
    grads = [np.full(2, 1e20, np.float32), np.array([3.0], np.float32)]
    norm = clip_grad_norm(grads, 1.0)
    assert norm == pytest.approx(np.sqrt(2) * 1e20, rel=1e-6)
    assert np.allclose(grads[0], 1 / np.sqrt(2), rtol=1e-6) and grads[1][0] > 0


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_a_non_finite_norm_scales_nothing(bad):
    grads = [np.array([bad, 1.0], np.float32)]
    norm = clip_grad_norm(grads, 1.0)
    assert not np.isfinite(norm)
    assert grads[0][1] == 1.0 and (np.isnan(grads[0][0]) if np.isnan(bad) else grads[0][0] == bad)


def test_max_grad_norm_on_float32_clips_large_gradients():
    params, grads = [np.zeros(2, np.float32)], [np.full(2, 1e20, np.float32)]
    SGD(params, grads, lr=1.0, max_grad_norm=1.0).step()
    assert np.allclose(params[0], -1 / np.sqrt(2), rtol=1e-6)


# -- aliasing in local optimizers ----------------------------------------------------------------

@pytest.mark.parametrize("cls", [SGD, Adam, AdamW])
@pytest.mark.parametrize("alias", ["same param twice", "views of one buffer", "grad is param",
                                   "same grad twice"])
def test_optimizers_refuse_arrays_sharing_memory(cls, alias):
    w, g = np.zeros((4, 3)), np.zeros((4, 3))
    params, grads = {"same param twice": ([w, w], [g, g.copy()]),
                     "views of one buffer": ([w[:2], w[1:3]], [g[:2], g[2:]]),
                     "grad is param": ([w], [w]),
                     "same grad twice": ([w, w.copy()], [g, g])}[alias]
    with pytest.raises(ValueError, match="share memory"):
        cls(params, grads, lr=0.1)


# -- the collective wrappers and array layouts ---------------------------------------------------

@pytest.mark.parametrize("layout", ["fortran", "strided"])
def test_the_collective_wrappers_refuse_arrays_not_in_c_order(layout):
    x = np.arange(12.0).reshape(3, 4)
    bad = np.asfortranarray(x) if layout == "fortran" else x[:, 1]
    comm = MPI.COMM_SELF
    for start in (lambda: iallreduce(comm, bad, np.empty_like(bad)),
                  lambda: iallreduce(comm, np.ascontiguousarray(bad), bad),
                  lambda: ibcast(comm, bad, 0),
                  lambda: iallgather(comm, bad, np.empty_like(bad)),
                  lambda: isend(comm, bad, 0, 1), lambda: irecv(comm, bad, 0, 1)):
        with pytest.raises(ValueError, match="must be C-contiguous"):
            start()


# -- state dicts with schedules ------------------------------------------------------------------

def test_a_state_dict_with_a_scheduled_lr_pickles_and_resumes_the_schedule():
    def make(params):
        return Adam([params], [np.full(3, 0.5)], lr=lambda step: 0.1 / step)

    reference = make(np.ones(3))
    for _ in range(2):
        reference.step()
    state = pickle.loads(pickle.dumps(reference.state_dict()))
    assert state["schedules"] == ["lr"]
    resumed = make(reference.params[0].copy())  # the params come from a model checkpoint
    resumed.load_state_dict(state)
    reference.step()
    resumed.step()
    assert np.array_equal(resumed.params[0], reference.params[0])
    with pytest.raises(ValueError, match=r"schedule \(a callable\) for \['lr'\]"):
        Adam([np.ones(3)], [np.ones(3)], lr=0.1).load_state_dict(state)


# -- whole programs --------------------------------------------------------------------------

NO_THREAD_CHOICE = {"OMP_NUM_THREADS": None, "OPENBLAS_NUM_THREADS": None,
                    "MKL_NUM_THREADS": None, "TENSORPLAY_MPI_THREADS": None}


def test_a_bad_environment_value_prints_one_traceback_per_rank():
    code = "from tensorplay_mpi import JoinableComm\nJoinableComm()"
    result = run_mpi(2, ["-c", code], timeout=60, TENSORPLAY_MPI_TIMEOUT="abc")
    said = result.stderr.count("ValueError: TENSORPLAY_MPI_TIMEOUT must be a positive number")
    assert result.returncode != 0 and said in (1, 2) and "atexit" not in result.stderr, \
        result.stderr


def test_an_unknown_variable_is_warned_about_once_on_rank_0():
    code = ("from tensorplay_mpi import JoinableComm\nfrom tensorplay_mpi.settings import "
            "settings\nfrom tensorplay_mpi.testing import reset_settings\nJoinableComm()\n"
            "reset_settings()\nsettings()")
    result = run_mpi(2, ["-c", code], timeout=60, TENSORPLAY_MPI_TIMOUT="5")
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("TENSORPLAY_MPI_TIMOUT is not a tensorplay_mpi setting") == 1
    assert "did you mean TENSORPLAY_MPI_TIMEOUT?" in result.stderr


def test_info_prints_the_blas_threads_line_once():
    result = run_mpi(2, ["-m", "tensorplay_mpi.info"], timeout=60, **NO_THREAD_CHOICE)
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    assert output.count("BLAS/OpenMP threads") == 1, output


def test_a_users_threadpool_limit_made_before_is_kept_and_said():
    code = ("from threadpoolctl import threadpool_info, threadpool_limits\nimport numpy\n"
            "threadpool_limits(1)\nfrom tensorplay_mpi import DataParallel\n"
            "DataParallel([numpy.zeros(2)])\n"
            "print('threads', [p['num_threads'] for p in threadpool_info()])")
    result = run_mpi(1, ["-c", code], timeout=60, **NO_THREAD_CHOICE)
    assert result.returncode == 0, result.stderr
    assert "threads [1]" in result.stdout, result.stdout
    if len(os.sched_getaffinity(0)) > 1:  # the share of the cores would be above 1
        assert "kept openblas at 1" in result.stderr, result.stderr


PLAIN_STEP = """
import numpy as np
from mpi4py import MPI
from tensorplay_mpi import DataParallel, Join
comm = MPI.COMM_WORLD
dp = DataParallel([np.zeros(3)], comm=comm)
try:
    with Join([dp]):
        for _ in range(0 if comm.rank == 0 else 3):
            dp.step()
except RuntimeError as error:
    print(f"RESULT rank={comm.rank} {type(error).__name__}: {error}", flush=True)
"""


def test_dp_step_without_with_and_a_rank_without_inputs_is_an_error_on_every_rank():
    """Rank 0 joined before any step: it learns the active rank's error in its wait."""
    result = run_mpi(2, ["-c", PLAIN_STEP], timeout=90)
    outcomes = results(result.stdout)
    assert sorted(outcomes) == [0, 1], result.stdout + result.stderr
    assert all("`with dp.step():`" in text for text in outcomes.values()), outcomes
