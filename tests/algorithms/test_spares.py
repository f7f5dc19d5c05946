"""SparePool where no rank is lost (any MPI): the trainers' split, a spare's wait ended by the
trainers' close, the refusals.  A spare taking a lost rank's place needs ULFM:
``make test-elastic`` (``tests/programs/elastic_spares.py``)."""

import subprocess

import numpy as np
import pytest

from tensorplay_mpi import SGD, DataParallel, Join, ZeroRedundancyOptimizer
from tensorplay_mpi.algorithms import SparePool
from tensorplay_mpi.algorithms import _elastic as elastic
from tensorplay_mpi.data import Sampler
from tensorplay_mpi.testing import assert_all, raises_everywhere, run_mpi

SAMPLES = 37


@pytest.mark.mpi
def test_the_trainers_train_alone_and_close_ends_the_waiting_spare(comm):
    spares = 1 if comm.size > 1 else 0
    pool = SparePool(comm, spares)
    trainers = comm.size - spares
    params = [np.zeros(3)]
    sampler = Sampler(SAMPLES, pool.comm.rank, pool.comm.size, batch_size=4)
    dp = DataParallel(params, comm=pool.comm)
    opt = SGD(params, dp.grads, lr=1.0)
    recruited = None
    if pool.spare:
        recruited = pool.wait([dp, opt], sampler)
    else:
        with Join([dp, opt], elastic=True):
            for idx in sampler:
                with dp.step():  # each step adds the mean over the world of the ids summed
                    dp.grads[0][...] = -float(np.sum(idx)) * dp.size
                opt.step()
        pool.close()
        pool.close()  # a second close does nothing
    # the expected sum of every id once: the trainers' split, nothing on the spare
    expected = np.full(3, SAMPLES * (SAMPLES - 1) / 2)
    mine = (pool.comm.size, bool(pool.spare))
    assert_all(recruited is False if pool.spare else
               np.allclose(params[0], expected) and mine == (trainers, False),
               f"spare {pool.spare}, recruited {recruited}, width {pool.comm.size}, "
               f"params {params[0]}")
    assert_all(pool.comm.rank == (comm.rank if comm.rank < trainers else 0))


@pytest.mark.mpi
def test_a_pool_without_a_trainer_and_misuse_are_refused(comm):
    for spares in (comm.size, -1):
        with raises_everywhere(ValueError, match="at least one process trains"):
            SparePool(comm, spares)
    for spares in (True, 1.0, "1"):
        with raises_everywhere(TypeError, match="spares must be an int"):
            SparePool(comm, spares)
    if comm.size > 1:
        with raises_everywhere(ValueError, match="different spares"):
            SparePool(comm, comm.rank % 2)
    assert_all(SparePool(comm, np.int64(0)).comm.size == comm.size)  # NumPy integers too
    pool = SparePool(comm, 1 if comm.size > 1 else 0)
    if pool.spare:
        with pytest.raises(RuntimeError, match="is a spare"):
            pool.refill(None, [])
        pool.close()  # a spare's close does nothing
        assert pool.wait([]) is False
    else:
        with pytest.raises(RuntimeError, match="this process trains"):
            pool.wait([])
        with pytest.raises(TypeError, match="takes the RanksLostError"):
            pool.refill(None, [])
        pool.close()
    assert_all(True)


@pytest.mark.mpi
def test_the_settle_with_a_root_gives_every_rank_that_rank_s_state(comm):
    """A recruit's adoption: the root's parameters and step count, even where it applied fewer
    updates than another rank (the elastic settle alone takes the most)."""
    params = [np.zeros(5)]
    dp = DataParallel(params, comm=comm)
    opt = SGD(params, dp.grads, lr=1.0)
    root = comm.size - 1
    params[0][...] = np.arange(5) + 10.0 * comm.rank  # replicas that differ, as a recruit's
    opt.steps = 7 if comm.rank == root else 9 + comm.rank
    step, used = elastic.settle(comm, [dp, opt], 60.0, root=root)
    expected = np.arange(5) + 10.0 * root
    assert_all((step, used, opt.steps) == (7, root, 7) and np.array_equal(params[0], expected),
               f"step {step} from {used}, steps {opt.steps}, params {params[0]}")


@pytest.mark.mpi
def test_a_sharded_optimizer_is_refused_with_spares(comm):
    """A recruit holds no shard and no copy of one: wait() and refill() refuse a ZeRO."""
    params = [np.zeros(4), np.zeros(3)]
    dp = DataParallel(params, comm=comm)
    zero = ZeroRedundancyOptimizer(params, dp.grads, SGD, lr=0.1, copies=True)
    pool = SparePool(comm, 0)
    with raises_everywhere(ValueError, match="holds no shard"):
        pool.refill(None, [dp, zero])
    pool.spare = True  # as a spare would call it
    with raises_everywhere(ValueError, match="holds no shard"):
        pool.wait([dp, zero])


FORGOTTEN_CLOSE = """
from mpi4py import MPI
from tensorplay_mpi.algorithms import SparePool
pool = SparePool(MPI.COMM_WORLD, 1)
if pool.spare:
    print("SPARE", pool.wait([]), flush=True)
"""  # the trainer ends without pool.close()


def test_a_trainer_that_forgets_close_ends_the_spares_at_exit():
    """The trainers' close() at exit: the waiting spare returns False, the job ends by itself."""
    try:
        result = run_mpi(2, ["-c", FORGOTTEN_CLOSE], timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the spare kept the job alive: no close() at the trainer's exit")
    assert result.returncode == 0 and "SPARE False" in result.stdout, result.stderr
