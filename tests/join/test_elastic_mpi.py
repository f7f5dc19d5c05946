"""Join(elastic=True) where no rank is lost (any MPI): refusals, the protocol unchanged, the
settle of an interrupted step.  Losses themselves need ULFM: ``make test-elastic``."""

import numpy as np
import pytest
from toys import AllReducer

from tensorplay_mpi import SGD, Adam, DataParallel, Join, JoinableComm, ZeroRedundancyOptimizer
from tensorplay_mpi.algorithms import elastic
from tensorplay_mpi.testing import assert_all, raises_everywhere


@pytest.mark.mpi
def test_joinables_that_cannot_go_on_are_refused_on_every_rank(comm):
    params = [np.zeros(4)]
    dp = DataParallel(params, comm=comm)
    zero = ZeroRedundancyOptimizer(params, dp.grads, Adam, comm=comm)
    with raises_everywhere(ValueError, match="ZeroRedundancyOptimizer cannot go on"):
        Join([dp, zero], elastic=True)
    with raises_everywhere(ValueError, match="AllReducer cannot go on"):
        Join([AllReducer(comm)], elastic=True)
    with raises_everywhere(ValueError, match="needs the joinable that applies the step"):
        Join([DataParallel([np.zeros(2)], comm=comm)], elastic=True)
    with raises_everywhere(TypeError, match="elastic must be True or False"):
        Join([JoinableComm(comm)], elastic="no")
    Join([JoinableComm(comm)], elastic=True)  # nothing to settle: a validation's Join


def dp_and_sgd(comm):
    """A DataParallel over one array of 3 zeros, and SGD (lr 1) stepping with its gradients."""
    dp = DataParallel([np.zeros(3)], comm=comm)
    return dp, SGD(dp.params, dp.grads, lr=1.0)


@pytest.mark.mpi
def test_no_sync_in_an_elastic_join_is_refused_on_every_rank(comm):
    dp, opt = dp_and_sgd(comm)
    with raises_everywhere(RuntimeError, match="no_sync\\(\\) inside an elastic Join"):
        with Join([dp, opt], elastic=True):
            with dp.no_sync(), dp.step():
                dp.grads[0][...] = 1.0


@pytest.mark.mpi
@pytest.mark.parametrize("owner", ["optimizer", "update"])
def test_an_elastic_join_with_uneven_inputs_equals_a_plain_one(comm, owner):
    def train(elastic_join):
        params = [np.linspace(0, 1, 6).reshape(2, 3), np.ones(3)]
        dp = DataParallel(params, comm=comm,  # the optimizer steps with these gradients
                          update=(lambda: opt.update()) if owner == "update" else None)
        opt = Adam(params, dp.grads, lr=0.1)
        joinables = [dp] if owner == "update" else [dp, opt]
        with Join(joinables, elastic=elastic_join):
            for step in range(2 + comm.rank):
                with dp.step():
                    dp.grads[0][...] = step + comm.rank
                    dp.grads[1][...] = -1.0
                if owner == "optimizer":
                    opt.step()
        return [p.copy() for p in params] + [opt.steps]

    plain, elastic_run = train(False), train(True)
    same = all(np.array_equal(a, b) for a, b in zip(plain, elastic_run))
    longest = comm.size + 1  # every rank steps as often as the one with the most inputs
    moved = not np.array_equal(plain[0], np.linspace(0, 1, 6).reshape(2, 3))
    assert_all(same and moved and plain[2] == longest,
               f"rank {comm.rank}: {elastic_run} != {plain}, or no step ({plain[2]} steps)")


@pytest.mark.mpi
def test_an_exception_in_an_elastic_join_propagates_unchanged(comm):
    dp, opt = dp_and_sgd(comm)
    with raises_everywhere(KeyError, match="mine"):
        with Join([dp, opt], elastic=True):
            with dp.step():
                dp.grads[0][...] = 1.0
            opt.step()
            raise KeyError("mine")
    with Join([dp, opt], elastic=True):  # the communicator stays usable
        with dp.step():
            dp.grads[0][...] = 1.0
        opt.step()
    assert_all(bool((dp.params[0] == -2.0).all()), f"rank {comm.rank}: {dp.params[0]}")


@pytest.mark.mpi(min_size=2)
def test_the_settle_gives_the_state_of_the_lowest_rank_that_applied_the_step(comm):
    """A survivor one update behind receives the parameters, the optimizer state and the
    counts of the lowest survivor that applied it (what an interrupted step leaves)."""
    params = [np.zeros(3)]
    dp = DataParallel(params, comm=comm)
    opt = Adam(params, dp.grads, lr=0.1)
    with Join([dp, opt]):
        for _ in range(2):
            with dp.step():
                dp.grads[0][...] = 1.0
            opt.step()
    ahead = comm.rank % 2 == 1  # ranks 1, 3: the interrupted step applied here only
    if ahead:
        dp.grads[0][...] = 5.0
        opt.update()
    expected = [a.copy() for a in opt._elastic_state()]
    for array in expected:  # rank 1's: the lowest rank ahead
        comm.Bcast(array, root=1)
    step, root = elastic.settle(comm, [dp, opt], 60.0)
    ok = (step, root) == (3, 1) and opt.steps == 3 and dp.steps == 2 and all(
        np.array_equal(a, e) for a, e in zip(opt._elastic_state(), expected))
    assert_all(ok, f"rank {comm.rank}: settled at {step} from {root}, params {params[0]} "
                   f"(rank 1's {expected[0]}), steps {opt.steps}/{dp.steps}")


@pytest.mark.mpi(min_size=2)
def test_survivors_more_than_one_update_apart_are_refused_on_every_rank(comm):
    with raises_everywhere(RuntimeError, match="more than the one an interrupted step"):
        elastic._agree_on_step(comm, 2 * comm.rank, 60.0)
