"""After a failure every rank caught at the same collective count, the next Join compares the
replicas: it raises on every rank, naming them, when one rank stepped and another did not."""

import numpy as np
import pytest

from tensorplay_mpi import SGD, DataParallel, Join
from tensorplay_mpi.comm._guard import Guard
from tensorplay_mpi.testing import assert_all, raises_everywhere


def model(comm):
    params = [np.zeros(3)]
    dp = DataParallel(params, comm=comm)
    return params, dp, SGD(params, dp.grads, lr=0.1, momentum=0.9)


def failing_epoch(comm, dp, opt, stepping_ranks):
    """Every rank raises in iteration 1 after dp.step(); `stepping_ranks` after opt.step()."""
    try:
        with Join([dp, opt]):
            for i in range(3):
                with dp.step():
                    dp.grads[0][...] = 1.0 + i
                if i == 1 and comm.rank not in stepping_ranks:
                    raise ValueError("bad batch")
                opt.step()
                if i == 1:
                    raise ValueError("bad batch")
    except ValueError:
        pass  # the program catches it and trains on


def epoch(dp, opt):
    with Join([dp, opt]):
        with dp.step():
            dp.grads[0][...] = 1.0
        opt.step()


@pytest.mark.mpi(min_size=2)
def test_replicas_that_differ_after_a_caught_failure_raise_on_every_rank(comm):
    params, dp, opt = model(comm)
    failing_epoch(comm, dp, opt, stepping_ranks=[0])
    with raises_everywhere(RuntimeError, match=r"the replicas differ .* ranks \[0\] / \[1"):
        epoch(dp, opt)
    epoch(dp, opt)  # checked once: the caller was told (and would restore a checkpoint)


@pytest.mark.mpi
def test_replicas_that_agree_after_a_caught_failure_go_on(comm):
    params, dp, opt = model(comm)
    failing_epoch(comm, dp, opt, stepping_ranks=list(range(comm.size)))
    assert_all(Guard.of(comm).replica_check_due, "no replica check after an intact failure")
    epoch(dp, opt)
    expected = -0.1 * (1.0 + (2.0 + 0.9 * 1.0)) - 0.1 * (1.0 + 0.9 * (2.0 + 0.9))
    assert_all(np.allclose(params[0], expected, rtol=0, atol=1e-12), f"{params[0]} != {expected}")


@pytest.mark.mpi
def test_without_a_failure_there_is_no_replica_check(comm):
    params, dp, opt = model(comm)
    epoch(dp, opt)
    epoch(dp, opt)
    assert_all(not Guard.of(comm).replica_check_due, "a replica check is due without a failure")
