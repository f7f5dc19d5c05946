"""DataParallel under mpiexec: exact against a serial replay with uneven batch counts."""

import numpy as np
import pytest
from helpers import UNEVEN, buckets_of, gathered_equal
from linear import make_problem, replay, train

from tensorplay_mpi import DataParallel, Join
from tensorplay_mpi.testing import assert_all, inputs_of, raises_everywhere


def close(params, expected, rtol):
    return all(np.allclose(p, e, rtol=rtol, atol=0) for p, e in zip(params, expected))


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", UNEVEN + ["even"])
@pytest.mark.parametrize("divide", [True, False])
@pytest.mark.parametrize("bucket_cap_mb", [1e-6, 25.0])  # one bucket per param; one in all
def test_sgd_equals_serial_replay(comm, pattern, divide, bucket_cap_mb):
    data, inputs = make_problem(), inputs_of(pattern, comm.size)
    params, dp = train(comm, data, inputs, divide_by_initial_world_size=divide,
                       bucket_cap_mb=bucket_cap_mb)
    expected = replay(data, inputs, divide_by_initial_world_size=divide)
    assert_all(len(buckets_of(dp.grads)) == (2 if bucket_cap_mb < 1 else 1), "bucket count")
    assert_all(close(params, expected, 1e-12), f"params {params} != replay {expected}")
    assert_all(gathered_equal(params, comm), "params differ across ranks at exit")
    # the joined ranks' hooks wrote the last average into their own grads
    assert_all(gathered_equal(list(dp.grads), comm), "grads differ across ranks at exit")


@pytest.mark.mpi(min_size=2)
def test_no_sync_leaves_gradients_local(comm):
    """Each rank keeps its own gradient (an average would differ on every rank)."""
    dp = DataParallel([np.zeros((2, 3)), np.zeros(4)], comm=comm)
    mine = np.full(4, comm.rank + 1.0)
    with Join([dp]):
        with dp.no_sync(), dp.step():
            dp.grads[1] = mine
    assert_all(np.array_equal(dp.grads[1], mine), f"rank {comm.rank}: {dp.grads[1]} != {mine}")


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", UNEVEN)
@pytest.mark.parametrize("sync_every", [2, 3])
def test_no_sync_accumulation_equals_serial_replay(comm, pattern, sync_every):
    data, inputs = make_problem(), inputs_of(pattern, comm.size)
    params, _ = train(comm, data, inputs, sync_every=sync_every,
                      divide_by_initial_world_size=False)
    expected = replay(data, inputs, sync_every=sync_every, divide_by_initial_world_size=False)
    assert_all(close(params, expected, 1e-12), f"params {params} != replay {expected}")
    assert_all(gathered_equal(params, comm), "params differ across ranks at exit")


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", UNEVEN)
def test_overlap_with_mark_ready_gives_the_same_bits(comm, pattern):
    data, inputs = make_problem(), inputs_of(pattern, comm.size)
    plain, _ = train(comm, data, inputs, bucket_cap_mb=1e-6)
    overlapped, _ = train(comm, data, inputs, bucket_cap_mb=1e-6, overlap=True)
    assert_all(all(np.array_equal(a, b) for a, b in zip(plain, overlapped)),
               "mark_ready changed the result")


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", UNEVEN)
def test_mixed_dtypes_get_one_bucket_set_each(comm, pattern):
    dtypes = (np.float32, np.float64)
    data, inputs = make_problem(), inputs_of(pattern, comm.size)
    params, dp = train(comm, data, inputs, dtypes=dtypes)
    expected = replay(data, inputs, dtypes=dtypes)
    kinds = sorted(str(bucket[0].dtype) for bucket in buckets_of(dp.grads))
    assert_all(kinds == ["float32", "float64"], f"buckets {kinds}")
    assert_all([p.dtype for p in params] == list(dtypes), "dtypes changed")
    assert_all(close(params, expected, 1e-5), f"params {params} != replay {expected}")
    assert_all(gathered_equal(params, comm), "params differ across ranks at exit")


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", UNEVEN + ["even"])
def test_buffers_follow_the_highest_active_rank(comm, pattern):
    inputs = inputs_of(pattern, comm.size)
    counter = np.zeros(2, dtype=np.int64)
    dp = DataParallel([np.zeros(3)], comm=comm, buffers=[counter])
    with Join([dp]):
        for _ in range(inputs[comm.rank]):
            with dp.step():
                dp.grads[0] = np.ones(3)
            counter += (1, 1 + comm.rank)  # a local update, as running statistics are
    # step t starts from the value of its highest active rank h_t, which h_t last updated in
    # step t - 1; the post hook hands out the final value of the highest last joiner
    highest = [max(r for r in range(comm.size) if inputs[r] > t) for t in range(max(inputs))]
    expected = np.zeros(2, dtype=np.int64)
    for h in highest[1:] + highest[-1:]:
        expected += (1, 1 + h)
    assert_all(np.array_equal(counter, expected), f"buffers {counter} != {expected}")


@pytest.mark.mpi(min_size=2)
def test_different_layouts_fail_on_every_rank(comm):
    shape = (3, 4) if comm.rank == 0 else (4, 3)
    with raises_everywhere(ValueError, match="different parameter"):
        DataParallel([np.zeros(shape)], comm=comm)


@pytest.mark.mpi(min_size=2)
def test_ranks_disagreeing_on_no_sync_fail_on_every_rank(comm):
    inputs = [1] + [2] * (comm.size - 1)  # rank 0 joins, the rest disagree in step 2
    dp = DataParallel([np.zeros(2)], comm=comm)
    error = None
    try:
        with Join([dp]):
            for t in range(inputs[comm.rank]):
                if t == 1 and comm.rank == 1:
                    with dp.no_sync(), dp.step():
                        pass
                else:
                    with dp.step():
                        pass
    except RuntimeError as exc:
        error = str(exc)
    if comm.size == 2:  # one active rank cannot disagree with itself
        assert_all(error is None, f"got {error!r}")
    else:
        assert_all(error is not None and "no_sync" in error, f"got {error!r}")


@pytest.mark.mpi
def test_constructor_broadcasts_from_the_chosen_rank(comm):
    root = comm.size - 1
    params = [np.full(4, float(comm.rank))]
    buffers = [np.full(2, comm.rank, dtype=np.int32)]
    DataParallel(params, comm=comm, broadcast_from=root, buffers=buffers)
    assert_all(np.all(params[0] == root) and np.all(buffers[0] == root), f"{params} {buffers}")


@pytest.mark.mpi(min_size=2)
def test_a_joined_rank_beside_active_ones_sums_a_large_bucket_exactly(comm):
    """A joined rank's zeros and the active ranks' gradients go through one allreduce, in
    place on every rank: Open MPI 5.0's libnbc gave MPI_ERR_TRUNCATE and wrong sums at 4
    ranks when some ranks passed MPI_IN_PLACE and others a send buffer (15,000 doubles)."""
    dp = DataParallel([np.zeros(20_000)], comm=comm)
    seen = []
    with Join([dp]):
        for _ in range(comm.rank + 1):
            with dp.step():
                dp.grads[0][...] = comm.rank + 1.0
            seen.append(dp.grads[0].copy())
    expected = [sum(r + 1.0 for r in range(comm.size) if r >= s) / comm.size
                for s in range(comm.rank + 1)]
    assert_all(all((g == e).all() for g, e in zip(seen, expected)),
               f"rank {comm.rank}: averages {[g[:2] for g in seen]} != {expected}")
