"""The link from a DataParallel to its optimizer, serially: carried by ``dp.grads`` only."""

import gc

import numpy as np
import pytest

from tensorplay_mpi import SGD, Adam, DataParallel, Join, ZeroRedundancyOptimizer
from tensorplay_mpi.parallel._gradient_link import GradientViews


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
