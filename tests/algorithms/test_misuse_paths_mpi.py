"""The misuse paths that used to be silent or wrong, under mpiexec: each ends with the right
result or a clear error on every rank, and the communicator stays usable."""

import gc

import numpy as np
import pytest
from mpi4py import MPI

from tensorplay_mpi import SGD, Adam, DataParallel, Join, JoinableComm
from tensorplay_mpi.testing import assert_all, inputs_of, raises_everywhere


def uneven_steps(comm, dp, steps, work):
    """Join([dp]) around `steps[rank]` calls of `work()` on each rank."""
    with Join([dp]):
        for _ in range(steps[comm.rank]):
            work()


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", ["even", "three_plus_rank"])
def test_dp_step_without_with_raises_on_every_rank(comm, pattern):
    """Every rank makes the slip, so every rank raises at its next step or at the Join's
    exit, before any collective: the communicator stays usable (a rank without inputs: see
    test_misuse_programs.py)."""
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
