"""JoinableComm's MAX and MIN of floats with NaN: the same result on every rank, on every
path (persistent, plain, carried in an announcement, announced with a rank joined), NaN
propagating as ``np.maximum``/``np.minimum`` do; checked against NumPy over the active ranks."""

import numpy as np
import pytest
from mpi4py import MPI

from tensorplay_mpi import Join, JoinableComm
from tensorplay_mpi.testing import assert_all

SIZES = {"small": 3, "large": 1000}  # large: neither persistent nor carried
VALUES = (2.5, -1.0, 0.0, -0.0, np.inf, -np.inf)


def values(rank, n, dtype, size):
    """Rank `rank`'s values; ranks 0 and the last (the one that never joins) hold NaNs."""
    x = np.array([VALUES[(rank + i) % len(VALUES)] for i in range(n)], dtype=dtype)
    if rank in (0, size - 1):
        x[rank % n] = np.nan
        x[-1] = -np.nan
    return x


def expected(ranks, n, dtype, size, op):
    rows = [values(r, n, dtype, size) for r in ranks]
    return (np.maximum if op is MPI.MAX else np.minimum).reduce(rows)


def same(a, b):
    return a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True) and \
        np.array_equal(np.isnan(a), np.isnan(b))


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("size", sorted(SIZES))
@pytest.mark.parametrize("op", [MPI.MAX, MPI.MIN], ids=["max", "min"])
def test_max_and_min_with_nan_agree_on_every_rank_and_path(comm, dtype, size, op):
    n, world = SIZES[size], comm.size
    jc = JoinableComm(comm)
    got = []
    got.append(jc.allreduce(values(comm.rank, n, dtype, world), op))  # persistent or plain
    work = jc.iallreduce(values(comm.rank, n, dtype, world), op)
    work.wait()
    got.append(work.result())
    iterations = 1 if comm.rank == 0 and world > 1 else 2  # rank 0 joins: announced
    with Join([jc]):
        for _ in range(iterations):
            jc.begin_iteration()
            got.append(jc.allreduce(values(comm.rank, n, dtype, world), op))
    every = range(world)
    active = range(1, world) if world > 1 else every
    wants = [expected(every, n, dtype, world, op)] * 3
    if iterations == 2:
        wants.append(expected(active, n, dtype, world, op))
    bad = [i for i, (g, w) in enumerate(zip(got, wants)) if not same(np.asarray(g), w)]
    ok = len(got) == len(wants) and not bad
    gathered = comm.allgather([np.asarray(g).tobytes() for g in got[:3]])
    assert_all(ok and all(g == gathered[0] for g in gathered),
               f"results {bad} of {len(got)} differ: got {[got[i] for i in bad]}, expected "
               f"{[wants[i] for i in bad]}")


@pytest.mark.mpi(min_size=2)
def test_numpy_scalars_take_the_path_of_0d_arrays(comm):
    """``arr.max()`` gives a NumPy scalar, not an array: its MAX propagates NaN as a 0-d
    array's does (as ``np.maximum.reduce``), and one rank's scalar meets another's 0-d array."""
    jc = JoinableComm(comm)
    values = np.array([np.nan] + [float(r) for r in range(1, comm.size)])
    scalar = jc.allreduce(values[comm.rank:comm.rank + 1].max(), MPI.MAX)
    mixed = jc.allreduce(np.float64(1.0) if comm.rank % 2 else np.ones(()))
    assert_all(bool(np.isnan(scalar)) and float(mixed) == comm.size,
               f"scalar MAX {scalar!r}, scalar beside a 0-d array {mixed!r}")
