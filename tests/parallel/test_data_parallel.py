"""DataParallel on one rank: buckets, gradient views, and every user error."""

import numpy as np
import pytest
from helpers import buckets_of
from mpi4py import MPI
from toys import AllReducer

from tensorplay_mpi import DataParallel, Join
from tensorplay_mpi.comm import outstanding_requests
from tensorplay_mpi.parallel._buckets import make_buckets


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
    ([np.zeros(3, np.int64)], TypeError, r"params\[0\] must be float32 or float64, got int64"),
    ([np.zeros(3, object)], TypeError, "float32 or float64"),
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
