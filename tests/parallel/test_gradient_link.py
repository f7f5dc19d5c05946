"""The link from a DataParallel to its optimizer: carried by ``dp.grads`` only (serially);
under mpiexec, a wrong or a missing link raises the same error on every rank, before any
collective of the Join."""

import gc

import numpy as np
import pytest

from tensorplay_mpi import SGD, Adam, DataParallel, Join, ZeroRedundancyOptimizer
from tensorplay_mpi.parallel._gradient_link import GradientViews
from tensorplay_mpi.testing import assert_all, inputs_of, raises_everywhere

def test_dp_grads_carry_their_dataparallel_and_a_list_of_them_carries_nothing():
    dp = DataParallel([np.ones(3)])
    assert GradientViews.of(dp.grads) is dp.grads
    assert dp.grads.data_parallel is dp
    assert GradientViews.of(list(dp.grads)) is None


@pytest.mark.parametrize("make", [
    lambda p, g: Adam(p, g),
    lambda p, g: ZeroRedundancyOptimizer(p, g, SGD, lr=0.1),
])
def test_grads_of_a_collected_dataparallel_raise_a_clear_error(make):
    params = [np.ones(3)]
    grads = DataParallel(params).grads
    gc.collect()
    with pytest.raises(RuntimeError, match="belong to a DataParallel that no longer exists"):
        make(params, grads)


def test_the_optimizer_made_last_with_dp_grads_is_the_one_checked():
    params = [np.ones(3)]
    dp = DataParallel(params)
    Adam(params, dp.grads)
    sgd = SGD(params, dp.grads, lr=0.1)  # stateless: replaces the Adam, need not join
    assert dp.grads.stateful_optimizer is None
    with Join([dp]):
        with dp.step():
            dp.grads[0][...] = 1.0
        sgd.step()
    np.testing.assert_array_equal(params[0], np.full(3, 0.9))


# -- under mpiexec at any rank count (@pytest.mark.mpi) --------------------------------------------

def run(comm, joinables, dp, opt, pattern):
    """Each rank's loop over its inputs under `pattern`."""
    with Join(joinables):
        for _ in range(inputs_of(pattern, comm.size)[comm.rank]):
            with dp.step():
                dp.grads[0][...] = comm.rank + 1
            opt.step()


def make(kind, params, grads, comm):
    if kind == "zero":
        return ZeroRedundancyOptimizer(params, grads, SGD, comm=comm, lr=0.5, momentum=0.5)
    return Adam(params, grads, lr=0.5)


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", ["rank0_zero", "three_plus_rank"])
@pytest.mark.parametrize("kind", ["adam", "zero"])
def test_an_optimizer_linked_to_another_dataparallel_raises_on_every_rank(comm, pattern, kind):
    """opt steps with dp.grads, but the Join lists another DataParallel before it."""
    params, other = [np.ones(4)], [np.ones(4)]
    dp, wrong = DataParallel(params, comm=comm), DataParallel(other, comm=comm)
    opt = make(kind, params, dp.grads, comm)
    with raises_everywhere(RuntimeError, match=r"must come before it in the Join: "
                                               r"Join\(\[dp, opt\]\) \(got Join\(\[Data"):
        run(comm, [wrong, opt], wrong, opt, pattern)
    assert_all(params[0].tolist() == [1.0] * 4, f"params changed: {params[0]}")


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", ["rank0_zero", "even"])
@pytest.mark.parametrize("kind", ["adam", "zero"])
def test_an_optimizer_listed_before_its_dataparallel_raises_on_every_rank(comm, pattern, kind):
    params = [np.ones(4)]
    dp = DataParallel(params, comm=comm)
    opt = make(kind, params, dp.grads, comm)
    with raises_everywhere(RuntimeError, match=r"Join\(\[dp"):  # opt's check or dp's
        run(comm, [opt, dp], dp, opt, pattern)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["adam", "zero"])
def test_a_missing_link_leaves_the_optimizer_unchecked_and_stepping_every_param(comm, kind):
    """A plain list of the same views carries no link: the optimizer is not checked against
    dp's Joins, and it steps every parameter (it cannot read dp.used)."""
    params = [np.ones(2), np.ones(3)]
    dp = DataParallel(params, comm=comm)
    opt = make(kind, params, list(dp.grads), comm)
    with Join([dp]):  # a linked stateful optimizer would raise here
        with dp.step(unused=[1]):
            dp.grads[0][...] = 1.0
    opt.step()
    # closed form: dp.grads[0] averages to 1, dp.grads[1] to 0 (unused everywhere); one step
    # of lr 0.5 moves params[0] by 0.5 (Adam: 0.5 / (1 + eps)) and leaves params[1]; the
    # step counts show that the unused params[1] was stepped all the same
    expected = [np.full(2, 0.5), np.ones(3)]
    counted = kind == "zero" or opt.param_steps.tolist() == [1, 1]
    ok = counted and all(np.allclose(p, e, rtol=0, atol=1e-7) for p, e in zip(params, expected))
    assert_all(ok, f"params {params}")
