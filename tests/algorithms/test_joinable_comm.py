"""JoinableComm under mpiexec: exact results as if joined ranks did not exist."""

import functools

import numpy as np
import pytest
from fake_device import FakeDeviceArray, on_device, use_mode
from helpers import UNEVEN
from mpi4py import MPI

from tensorplay_mpi import DataParallel, Join, JoinableComm, Work
from tensorplay_mpi.algorithms._announcements import (NOBODY, PAYLOAD, PAYLOAD_AT, SLOTS,
                                                      float_keys, float_values, from_order_keys,
                                                      identity, order_keys, slot_sum, slot_words)
from tensorplay_mpi.testing import assert_all, inputs_of, raises_everywhere

NUMPY_OPS = {"SUM": np.add, "PROD": np.multiply, "MAX": np.maximum, "MIN": np.minimum,
             "LAND": np.logical_and, "LOR": np.logical_or, "BAND": np.bitwise_and,
             "BOR": np.bitwise_or}
CASES = [(dtype, op) for dtype in ("float32", "float64") for op in ("SUM", "PROD", "MAX", "MIN")]
CASES += [(dtype, op) for dtype in ("int32", "int64")
          for op in ("SUM", "PROD", "MAX", "MIN", "BAND", "BOR")]
CASES += [("bool", "LAND"), ("bool", "LOR"), ("int32", "LAND"), ("int64", "LOR")]


def data(rank, t, dtype, n=3):
    """Rank `rank`'s values in iteration `t`: small integers, so every float sum is exact."""
    values = (np.arange(n) * 7 + rank * 5 + t * 3) % 11 - 4
    return (values % 2 == 0) if dtype == "bool" else values.astype(dtype)


def rows_of(rank, t):
    return np.array([[rank, t, i] for i in range((rank + t) % 3)], np.int64).reshape(-1, 3)


def active(inputs, t):
    return [r for r in range(len(inputs)) if inputs[r] > t]


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", UNEVEN + ["even", "one_straggler"])
def test_every_op_and_dtype_equals_a_reduction_over_the_active_ranks(comm, pattern):
    inputs = inputs_of(pattern, comm.size)
    jc = JoinableComm(comm)
    got = []
    with Join([jc]):
        for t in range(inputs[comm.rank]):
            jc.begin_iteration()
            got.append([jc.allreduce(data(comm.rank, t, d), getattr(MPI, op)) for d, op in CASES])
    bad = []
    for t, results in enumerate(got):
        for (dtype, op), result in zip(CASES, results):
            values = [data(r, t, dtype) for r in active(inputs, t)]
            if comm.size > 1:  # joined ranks' identities, or none: integer LAND, LOR give 0
                values.append(identity(getattr(MPI, op), dtype))  # or 1 as over 2 ranks (MPI
            expected = functools.reduce(NUMPY_OPS[op], values)  # over 1 applies no op)
            if result.dtype != np.dtype(dtype) or not np.array_equal(result, expected):
                bad.append(f"iteration {t} {op} {dtype}: {result} != {expected}")
    assert_all(not bad, "; ".join(bad[:3]))


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", UNEVEN + ["even", "one_straggler"])
def test_gathers_broadcasts_and_a_schedule_that_grows(comm, pattern):
    inputs = inputs_of(pattern, comm.size)
    longest = max(inputs)
    jc = JoinableComm(comm)
    bad = []
    with Join([jc]):
        for t in range(inputs[comm.rank]):
            jc.begin_iteration()
            ranks = active(inputs, t)
            gathered = jc.allgather(rows_of(comm.rank, t))
            expected = np.concatenate([rows_of(r, t) for r in ranks])
            if not np.array_equal(gathered, expected):
                bad.append(f"allgather {t}: {gathered.tolist()} != {expected.tolist()}")
            top = jc.bcast(data(comm.rank, t, "float64"), root="highest_active")
            low = jc.bcast(data(comm.rank, t, "int32"), root=ranks[0])
            if not (np.array_equal(top, data(ranks[-1], t, "float64"))
                    and np.array_equal(low, data(ranks[0], t, "int32"))):
                bad.append(f"bcast {t}: {top} {low}")
            if t >= longest // 2:  # the second half adds a collective
                peak = jc.allreduce(np.array([comm.rank]), MPI.MAX)
                if peak[0] != ranks[-1]:
                    bad.append(f"late allreduce {t}: {peak}")
    assert_all(not bad, "; ".join(bad[:3]))


@pytest.mark.mpi(min_size=2)
def test_a_joined_int_root_is_an_error_on_every_rank(comm):
    inputs = [1] + [3] * (comm.size - 1)  # rank 0 joins after one iteration
    jc = JoinableComm(comm)
    with raises_everywhere(ValueError, match="bcast root 0 is not an active rank"):
        with Join([jc]):
            for _ in range(inputs[comm.rank]):
                jc.begin_iteration()
                jc.bcast(np.zeros(2), root=0)
    with Join([jc]):  # the communicator is still usable
        for _ in range(1 + comm.rank):
            jc.begin_iteration()
            jc.allreduce(np.ones(1))


@pytest.mark.mpi(min_size=2)
def test_an_int_root_that_joined_is_an_error_where_one_rank_is_left(comm):
    """The only active rank (a count of one read) issues no data
    collective: a bcast from a joined int root still raises on every rank."""
    jc = JoinableComm(comm)
    with raises_everywhere(ValueError, match="bcast root 0 is not an active rank"):
        with Join([jc]):
            for t in range(4 if comm.rank == comm.size - 1 else 1):
                jc.begin_iteration()
                jc.bcast(np.zeros(2), root=comm.size - 1 if t < 3 else 0)


@pytest.mark.mpi
@pytest.mark.parametrize("last", [1, 4])  # with 4, the last rank is left alone
def test_i_variants_return_works_and_results_keep_the_input_kind(comm, monkeypatch, last):
    use_mode(monkeypatch, aware=False)
    jc = JoinableComm(comm)
    with Join([jc]):
        mine = 1 + comm.rank if last == 1 else (last if comm.rank == comm.size - 1 else 1)
        for _ in range(mine):
            jc.begin_iteration()
            work = jc.iallreduce(on_device(np.ones(4)))
            gathered = jc.allgather(on_device(np.ones((1, 2))))
    assert_all(isinstance(work, Work) and type(work.result()) is FakeDeviceArray, repr(work))
    assert_all(type(gathered) is FakeDeviceArray, type(gathered).__name__)


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", UNEVEN)
def test_beside_data_parallel(comm, pattern):
    inputs = inputs_of(pattern, comm.size)
    dp = DataParallel([np.zeros(2)], comm=comm)
    jc = JoinableComm(comm)
    counts = []
    with Join([dp, jc]):
        for _ in range(inputs[comm.rank]):
            with dp.step():
                dp.grads[0] = np.ones(2)
            jc.begin_iteration()
            counts.append(int(jc.allreduce(np.array([1]))[0]))
    expected = [len(active(inputs, t)) for t in range(inputs[comm.rank])]
    assert_all(counts == expected, f"{counts} != {expected}")


@pytest.mark.mpi(min_size=2)
def test_an_operation_before_begin_iteration_is_a_runtime_error(comm):
    jc = JoinableComm(comm)
    with raises_everywhere(RuntimeError, match="begin_iteration"):
        with Join([jc]):
            jc.allreduce(np.ones(1))


def test_identities():
    assert identity(MPI.SUM, np.float32) == 0 and identity(MPI.PROD, np.int64) == 1
    assert identity(MPI.MAX, np.float64) == -np.inf and identity(MPI.MIN, np.int32) == 2**31 - 1
    assert identity(MPI.MAX, np.int8) == -128 and identity(MPI.BAND, np.uint8) == 255
    assert identity(MPI.LAND, np.bool_) and not identity(MPI.LOR, np.bool_)
    with pytest.raises(ValueError, match="supports the ops"):
        identity(MPI.MAXLOC, np.float64)


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64", "uint8", "uint16",
                                   "uint32", "uint64", "float16", "float32", "float64", "bool"])
def test_keys_that_announcements_carry_keep_the_order_of_the_values(dtype):
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        info = np.finfo(dtype)
        special = [-np.inf, info.min, -1.5, -info.tiny, -0.0, 0.0, info.tiny, 2.5, info.max, np.inf]
    elif dtype.kind == "b":
        special = [False, True]
    else:
        info = np.iinfo(dtype)
        special = [info.min, info.min + 1, 0, 1, info.max - 1, info.max]
    a = np.array(special, dtype)
    b = np.random.default_rng(0).permutation(a)
    for reduce, reverse in ((np.maximum, False), (np.minimum, True)):
        if dtype.kind == "f":  # floats travel as the integer keys of float_keys first
            ka, kb = float_keys(a, not reverse), float_keys(b, not reverse)
            keys = from_order_keys(np.maximum(order_keys(ka, reverse), order_keys(kb, reverse)),
                                   ka.dtype, reverse)
            carried = float_values(keys, dtype)
        else:
            carried = from_order_keys(np.maximum(order_keys(a, reverse), order_keys(b, reverse)),
                                      dtype, reverse)
        assert carried.dtype == dtype and carried.tobytes() == reduce(a, b).tobytes(), reduce


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_sums_in_slots_are_the_sums_of_the_values_bit_for_bit(dtype):
    """Each rank's values in its own slots of the payload, MAX-reduced (a joined rank writes
    NOBODY everywhere), then summed in rank order: bit for bit NumPy's sums, signed zeros,
    infinities and NaN included, a joined rank's slots adding nothing."""
    info = np.finfo(dtype)
    special = np.array([-0.0, 0.0, -0.0, 1.5, -info.tiny, info.max, -np.inf, np.nan], dtype)
    rng = np.random.default_rng(1)
    ranks = [special, rng.permutation(special), rng.normal(size=8).astype(dtype), special]
    for active in ([0, 1], [0, 1, 2, 3], [1, 3], [2], [0], [0, 3]):  # of 4; the others joined
        rows = []
        for r in range(4):
            row = np.full(SLOTS, NOBODY, np.int64)
            if r in active:
                row[PAYLOAD_AT + r * 8:PAYLOAD_AT + (r + 1) * 8] = slot_words(ranks[r])
            rows.append(row)
        got = slot_sum(np.maximum.reduce(rows), np.dtype(dtype), 8, 4)
        expected = ranks[active[0]].copy()
        with np.errstate(over="ignore", invalid="ignore"):
            for r in active[1:]:
                expected = expected + ranks[r]
        assert got.dtype == dtype and got.tobytes() == expected.tobytes(), (active, got)
    assert 4 * 8 <= PAYLOAD


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", ["even", "rank0_zero", "one_straggler"])
@pytest.mark.parametrize("count", [1, 3, 17])  # 17: in slots at 1 rank only (32 words)
def test_float_sums_are_the_same_on_every_rank_and_the_sum_in_rank_order(comm, pattern, count):
    """Floats that do not sum exactly (the small sums travel in the announcement's slots):
    every rank, joined ones through a kept array, holds the same bits, those of the sum over
    the active ranks' values in rank order."""
    inputs = inputs_of(pattern, comm.size)
    jc = JoinableComm(comm)
    kept = {dtype: jc.keep(np.zeros(count, dtype)) for dtype in ("float32", "float64")}

    def values(rank, t, dtype):
        return np.random.default_rng([rank, t, count]).normal(size=count).astype(dtype)

    got = []
    with Join([jc]):
        for t in range(inputs[comm.rank]):
            jc.begin_iteration()
            got.append([jc.allreduce(values(comm.rank, t, d), out=kept[d]).copy()
                        for d in kept])
    bad = []
    for t, results in enumerate(got):
        for dtype, result in zip(kept, results):
            ranks = active(inputs, t)
            expected = values(ranks[0], t, dtype)
            for r in ranks[1:]:
                expected = expected + values(r, t, dtype)
            in_slots = count * comm.size <= PAYLOAD  # else MPI's own order of additions:
            bound = len(ranks) * np.finfo(dtype).eps * sum(  # within n eps of the sum of |x|
                np.abs(values(r, t, dtype).astype(np.float64)) for r in ranks)
            if (result.tobytes() != expected.tobytes() if in_slots
                    else not (np.abs(result - expected.astype(np.float64)) <= bound).all()):
                bad.append(f"iteration {t} {dtype}: {result} != {expected}")
    final = np.concatenate([kept["float32"].astype(np.float64), kept["float64"]])
    every = comm.allgather(final.tobytes())
    assert_all(not bad and len(set(every)) == 1,
               "; ".join(bad[:3]) or "ranks hold different kept results")


@pytest.mark.mpi(min_size=2)
def test_a_sum_of_negative_zeros_is_negative_zero_on_every_path(comm):
    """-0.0 is the sum's identity: a joined rank contributes it, so a sum of -0.0 over the
    active ranks is -0.0 whether it travels in the announcement's slots or in an allreduce."""
    counts = (PAYLOAD // comm.size, PAYLOAD // comm.size + 1)  # in slots, then not
    jc = JoinableComm(comm)
    signs = []
    with Join([jc]):
        for _ in range(0 if comm.rank == 0 else 1):  # rank 0 joined from the start
            jc.begin_iteration()
            signs += [bool(np.signbit(jc.allreduce(np.full(n, -0.0, dtype))).all())
                      for n in counts for dtype in (np.float32, np.float64)]
    assert_all(all(signs), f"rank {comm.rank}: signs {signs} (counts {counts})")


@pytest.mark.mpi
def test_results_can_go_into_given_buffers(comm):
    jc = JoinableComm(comm)
    total, top = np.empty(3), np.empty(2, np.int64)
    with Join([jc]):
        for _ in range(1 + comm.rank):
            jc.begin_iteration()
            got = jc.allreduce(np.ones(3), out=total)
            peak = jc.bcast(np.full(2, comm.rank), out=top)
    assert_all(got is total and peak is top, "results did not land in the given buffers")
    # this rank's last iteration, t = rank, had ranks rank..size-1 active
    assert_all(total.tolist() == [float(comm.size - comm.rank)] * 3, f"{total}")
    assert_all(top.tolist() == [comm.size - 1] * 2, f"{top}")
    with raises_everywhere(ValueError, match="shaped and typed like the input"):
        with Join([jc]):
            jc.begin_iteration()
            jc.allreduce(np.ones(3), out=np.empty(2))


@pytest.mark.mpi(min_size=2)
def test_an_allreduce_in_place_on_some_ranks_only_is_exact(comm):
    """``out=x`` on rank 0, a new result elsewhere: one in-place allreduce on every rank (Open
    MPI 5.0's libnbc mismatched the two kinds of call at 4 ranks)."""
    jc = JoinableComm(comm)
    x = np.full(20_000, comm.rank + 1.0)
    result = jc.allreduce(x, out=x) if comm.rank == 0 else jc.allreduce(x)
    total = comm.size * (comm.size + 1) / 2
    assert_all(bool((result == total).all()), f"rank {comm.rank}: {result[:3]} != {total}")
