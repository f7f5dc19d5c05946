"""The misuse paths that used to be silent or wrong: serial checks, whole programs under
mpiexec where the output of every rank is the verdict, and in-process tests under mpiexec where
each ends with the right result or a clear error on every rank, and the communicator stays
usable."""

import gc
import os
import pickle

import numpy as np
import pytest
from helpers import results
from mpi4py import MPI

from tensorplay_mpi import SGD, Adam, AdamW, DataParallel, Join, JoinableComm
from tensorplay_mpi.comm import iallgather, iallreduce, ibcast, irecv, isend
from tensorplay_mpi.optim import clip_grad_norm
from tensorplay_mpi.testing import assert_all, inputs_of, raises_everywhere, run_mpi

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


# -- under mpiexec at any rank count (@pytest.mark.mpi) --------------------------------------------

def uneven_steps(comm, dp, steps, work):
    """Join([dp]) around `steps[rank]` calls of `work()` on each rank."""
    with Join([dp]):
        for _ in range(steps[comm.rank]):
            work()


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", ["even", "three_plus_rank"])
def test_dp_step_without_with_raises_on_every_rank(comm, pattern):
    """Every rank makes the slip, so every rank raises at its next step or at the Join's
    exit, before any collective: the communicator stays usable (a rank without inputs: the
    launched test_dp_step_without_with_and_a_rank_without_inputs_is_an_error_on_every_rank)."""
    params = [np.zeros(3)]
    dp = DataParallel(params, comm=comm)

    def plain_call():
        dp.step()  # the slip: no `with`
        dp.grads[0][...] = comm.rank + 1

    with raises_everywhere(RuntimeError, match=r"dp.step\(\) was called without `with`.*"
                                               r"`with dp.step\(\):`"):
        uneven_steps(comm, dp, inputs_of(pattern, comm.size), plain_call)

    def step():  # the communicator and dp still work, and average
        with dp.step():
            dp.grads[0][...] = comm.rank + 1

    uneven_steps(comm, dp, [1] * comm.size, step)
    assert_all(np.all(dp.grads[0] == (comm.size + 1) / 2), f"grads {dp.grads[0]}")


@pytest.mark.mpi
def test_no_sync_without_with_raises_on_every_rank(comm):
    dp = DataParallel([np.zeros(3)], comm=comm)
    with raises_everywhere(RuntimeError, match=r"`with dp.no_sync\(\):`"):
        dp.no_sync()
        with dp.step():
            pass


@pytest.mark.mpi
@pytest.mark.parametrize("make", ["Join", "dp.join"])
def test_a_join_never_entered_raises_on_every_rank(comm, make):
    dp = DataParallel([np.zeros(3)], comm=comm)
    with raises_everywhere(RuntimeError, match="never entered.*`with Join"):
        Join([dp]) if make == "Join" else dp.join()  # the slip: no `with`
        with dp.step():
            pass


# -- JoinableComm: any layout, in both modes ---------------------------------------------------

def jc_iteration(comm, jc, joined, operation):
    """`operation()` in an iteration where every rank is active (`joined` False) or the last
    rank has joined; returns its result on active ranks (None on the joined one)."""
    result = None
    with Join([jc]):
        for i in range(2 if joined else 1):
            jc.begin_iteration()
            if i == 1 or not joined:
                result = operation()
            if joined and comm.rank == comm.size - 1:
                break
    return result


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("joined", [False, True])
def test_allgather_of_fortran_ordered_rows_is_exact(comm, joined):
    jc = JoinableComm(comm)
    rows = np.asfortranarray(np.arange(6.0).reshape(3, 2) + 10 * comm.rank)
    got = jc_iteration(comm, jc, joined, lambda: jc.allgather(rows))
    active = comm.size - 1 if joined else comm.size
    expected = np.concatenate([np.arange(6.0).reshape(3, 2) + 10 * r for r in range(active)])
    inactive = joined and comm.rank == comm.size - 1
    assert_all(inactive or np.array_equal(got, expected), f"got {got}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("joined", [False, True])
@pytest.mark.parametrize("rows", [2, 40])  # carried in the announcement, or not
def test_a_strided_allreduce_is_exact(comm, joined, rows):
    jc = JoinableComm(comm)
    x = np.arange(rows * 3.0).reshape(rows, 3) * (comm.rank + 1)
    got = jc_iteration(comm, jc, joined, lambda: jc.allreduce(x[:, 1], op=MPI.MAX))
    active = comm.size - 1 if joined else comm.size
    inactive = joined and comm.rank == comm.size - 1
    assert_all(inactive or np.array_equal(got, np.arange(rows * 3.0)[1::3] * active),
               f"got {got}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("joined", [False, True])
@pytest.mark.parametrize("call", ["bcast_fortran_out", "allreduce_strided_in_place"])
def test_a_misordered_out_is_refused_on_every_rank_and_the_comm_stays_usable(comm, joined,
                                                                           call):
    jc = JoinableComm(comm)
    x = np.arange(60.0).reshape(20, 3)

    def operation():
        if call == "bcast_fortran_out":
            return jc.bcast(x, root=0, out=np.asfortranarray(np.zeros_like(x)))
        column = x[:, 0]
        return jc.allreduce(column, out=column)

    with raises_everywhere(ValueError, match="C-contiguous|bad argument"):
        jc_iteration(comm, jc, joined, operation)
    got = jc_iteration(comm, jc, joined, lambda: jc.allreduce(np.ones(20)))
    active = comm.size - 1 if joined else comm.size
    inactive = joined and comm.rank == comm.size - 1
    assert_all(inactive or np.array_equal(got, np.full(20, float(active))), f"got {got}")


# -- aliasing ------------------------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("alias", ["same array twice", "views of one buffer", "a buffer"])
def test_dataparallel_refuses_arrays_sharing_memory_on_every_rank(comm, alias):
    w = np.zeros((4, 3))
    params, buffers = {"same array twice": ([w, np.zeros(2), w], []),
                       "views of one buffer": ([w[:2], w[1:]], []),
                       "a buffer": ([w], [w[3]])}[alias]
    with raises_everywhere(ValueError, match="share memory"):
        DataParallel(params, comm=comm, buffers=buffers)


# -- optimizers: which one is live ---------------------------------------------------------------

@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("collector", ["disabled", "enabled"])
def test_an_optimizer_replaced_between_joins_is_never_counted(comm, collector):
    """The old Adam stays alive (a reference cycle, the collector off or on): the SGD bound
    after it is the one DataParallel checks, on every rank alike."""
    inputs = inputs_of("three_plus_rank", comm.size)
    params = [np.ones(4)]
    dp = DataParallel(params, comm=comm)
    was_enabled = gc.isenabled()
    if collector == "disabled":
        gc.disable()
    try:
        opt = Adam(params, dp.grads, lr=0.1)
        opt.cycle = opt  # kept alive until a collection, whatever the program does
        run(comm, dp, opt, inputs)
        opt = SGD(params, dp.grads, lr=0.1)
        if collector == "enabled":
            gc.collect()
        before = params[0].copy()
        error = run(comm, dp, opt, inputs)
    finally:
        if was_enabled:
            gc.enable()
    average = [sum(r + 1 for r in range(comm.size) if inputs[r] > t) / comm.size
               for t in range(max(inputs))]
    expected = before - 0.1 * sum(average)
    assert_all(error is None and np.allclose(params[0], expected, rtol=1e-12, atol=0),
               f"{error!r}, {params[0]} != {expected}")


def run(comm, dp, opt, inputs):
    """Join([dp]) with `opt` stepped in the loop but not listed; the error text, or None."""
    try:
        with Join([dp]) if isinstance(opt, SGD) else Join([dp, opt]):
            for _ in range(inputs[comm.rank]):
                with dp.step():
                    dp.grads[0][...] = comm.rank + 1
                opt.step()
    except RuntimeError as error:
        return str(error)
    return None
