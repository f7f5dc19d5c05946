"""DataParallel on one rank: buckets, gradient views, and every user error; under mpiexec,
exact against a serial replay with uneven batch counts."""

import numpy as np
import pytest
from helpers import UNEVEN, buckets_of, gathered_equal
from linear import make_problem, replay, train
from mpi4py import MPI
from toys import AllReducer

from tensorplay_mpi import DataParallel, Join
from tensorplay_mpi.comm import outstanding_requests
from tensorplay_mpi.parallel._buckets import make_buckets
from tensorplay_mpi.testing import assert_all, inputs_of, raises_everywhere

@pytest.fixture
def dp():
    return DataParallel([np.zeros((2, 3)), np.zeros(4)], comm=MPI.COMM_SELF)


def test_buckets_fill_in_reverse_order_up_to_the_cap():
    params = [np.zeros(100) for _ in range(4)]  # 800 bytes each
    buckets, bucket_of, _ = make_buckets(params, cap_bytes=1600)
    assert [b.members for b in buckets] == [[3, 2], [1, 0]]
    assert bucket_of == [1, 1, 0, 0]


def test_a_parameter_over_the_cap_gets_its_own_bucket_and_dtypes_never_mix():
    params = [np.zeros(10), np.zeros(1000), np.zeros(10, np.float32), np.zeros(10)]
    buckets, _, _ = make_buckets(params, cap_bytes=200)
    assert [(b.members, str(b.flat.dtype)) for b in buckets] == [
        ([3], "float64"), ([2], "float32"), ([1], "float64"), ([0], "float64")]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_averaging_a_bucket_is_bitwise_a_division_whatever_the_divisor(dtype):
    rng = np.random.default_rng(0)
    info = np.finfo(dtype)
    values = np.concatenate([rng.normal(size=997) * 10.0 ** rng.integers(-30, 30, size=997),
                             [info.tiny, info.tiny / 8, info.max, -info.max, 0.0, -0.0,
                              np.inf, -np.inf, np.nan]]).astype(dtype)
    (bucket,), _, _ = make_buckets([np.zeros(values.size, dtype)], cap_bytes=1 << 20)
    for divisor in (1, 2, 3, 4, 6, 8, 64, 1000, 1024, 2.0 ** 40, 7.0):
        bucket.grads[...] = values
        bucket.divide(divisor)
        expected = values / np.asarray(divisor, dtype)
        assert np.array_equal(bucket.grads.view(np.uint8), expected.view(np.uint8)), divisor


def test_grads_are_zero_copy_views_into_one_bucket_filled_in_reverse(dp):
    (bucket,) = buckets_of(dp.grads)
    dp.grads[0][...] = 1.0
    dp.grads[1] = np.arange(4.0)
    assert [g.shape for g in dp.grads] == [(2, 3), (4,)] and len(bucket) == 2
    address = [g.__array_interface__["data"][0] for g in dp.grads]
    assert address[0] == address[1] + dp.grads[1].nbytes  # the last parameter's comes first
    np.testing.assert_array_equal(dp.grads[0], np.ones((2, 3)))


def test_a_single_rank_step_averages_over_itself(dp):
    with Join([dp]):
        with dp.step():
            dp.grads[1] = np.arange(4.0)
    np.testing.assert_array_equal(dp.grads[1], np.arange(4.0))


def test_grads_write_of_the_wrong_shape_is_a_value_error(dp):
    with pytest.raises(ValueError, match=r"grads\[1\] has shape \(4,\), got .* \(3,\)"):
        dp.grads[1] = np.zeros(3)


@pytest.mark.parametrize("params, error, match", [
    ([np.zeros(3, np.int64)], TypeError,
     r"params\[0\] must be float32, float64, float16 or bfloat16, got int64"),
    ([np.zeros(3, object)], TypeError, "float32, float64, float16 or bfloat16"),
    ([[1.0, 2.0]], TypeError, "must be a NumPy or CuPy array or a torch tensor, got list"),
    ([np.zeros((4, 4))[:, 1]], ValueError, "C-contiguous"),
    (np.zeros(3), TypeError, r"pass a sequence of arrays \(got one ndarray: use \[array\]\)"),
])
def test_bad_params(params, error, match):
    with pytest.raises(error, match=match):
        DataParallel(params, comm=MPI.COMM_SELF)


def test_object_buffers_are_a_type_error():
    with pytest.raises(TypeError, match="object"):
        DataParallel([np.zeros(2)], comm=MPI.COMM_SELF, buffers=[np.zeros(2, object)])


def test_read_only_params_are_a_value_error():
    param = np.zeros(2)
    param.flags.writeable = False
    with pytest.raises(ValueError, match=r"params\[0\] is read-only"):
        DataParallel([param], comm=MPI.COMM_SELF)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb must be > 0, got 0"),
    ({"broadcast_from": 1}, ValueError, r"broadcast_from must be a rank in \[0, 1\), got 1"),
    ({"broadcast_from": 0.5}, TypeError, "broadcast_from must be an int rank, got 0.5"),
    ({"broadcast_from": False}, TypeError, "broadcast_from must be an int rank, got False"),
])
def test_bad_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        DataParallel([np.zeros(2)], comm=MPI.COMM_SELF, **kwargs)


def test_a_numpy_integer_broadcast_from_is_a_rank():
    DataParallel([np.zeros(2)], comm=MPI.COMM_SELF, broadcast_from=np.int64(0))


def test_nested_steps_are_a_runtime_error(dp):
    with dp.step():
        with pytest.raises(RuntimeError, match="cannot nest"):
            with dp.step():
                pass


def test_mark_ready_misuse(dp):
    with pytest.raises(RuntimeError, match="inside dp.step"):
        dp.mark_ready(0)
    with dp.step():
        dp.mark_ready(0)
        with pytest.raises(RuntimeError, match=r"mark_ready\(0\) was already called"):
            dp.mark_ready(0)
        with pytest.raises(IndexError, match="out of range"):
            dp.mark_ready(2)


def test_no_sync_inside_a_step_is_a_runtime_error(dp):
    with dp.step():
        with pytest.raises(RuntimeError, match="outside a step"):
            with dp.no_sync():
                pass


def test_data_parallel_must_be_the_first_joinable(dp):
    with Join([AllReducer(MPI.COMM_SELF), dp]):
        with pytest.raises(RuntimeError, match="first joinable"):
            with dp.step():
                pass


def test_join_shorthand_and_exception_in_a_step(dp):
    with pytest.raises(KeyError):
        with dp.join(divide_by_initial_world_size=False):
            with dp.step():
                dp.mark_ready(0)
                dp.mark_ready(1)  # starts the bucket: the failed step must complete it
                raise KeyError("in the step")
    assert outstanding_requests() == 0


# -- under mpiexec at any rank count (@pytest.mark.mpi) --------------------------------------------

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
