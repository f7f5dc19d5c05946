"""The device code paths under mpiexec, on a fake device array: staged and CUDA-aware."""

import numpy as np
import pytest
from fake_device import Counters, FakeDeviceArray, on_device, use_mode
from helpers import UNEVEN, gathered_equal
from linear import make_problem, train

from tensorplay_mpi import Adam, DataParallel, Join, ZeroRedundancyOptimizer
from tensorplay_mpi.testing import assert_all, inputs_of


@pytest.mark.mpi
@pytest.mark.parametrize("aware", [False, True])
@pytest.mark.parametrize("pattern", UNEVEN)
def test_data_parallel_on_the_device_equals_the_host_run(comm, monkeypatch, aware, pattern):
    use_mode(monkeypatch, aware)
    data, inputs = make_problem(), inputs_of(pattern, comm.size)
    expected, _ = train(comm, data, inputs, bucket_cap_mb=1e-6)
    Counters.reset()
    params, dp = train(comm, data, inputs, bucket_cap_mb=1e-6, device=on_device)
    same = all(type(p) is FakeDeviceArray and np.array_equal(p, e)
               for p, e in zip(params, expected))
    assert_all(same, "the device run left the host run")
    assert_all(gathered_equal(params, comm), "params differ across ranks")
    assert_all(Counters.syncs > 0, "no stream was synchronised before MPI")
    copies = Counters.d2h + Counters.h2d
    assert_all((copies == 0) if aware else (copies > 0), f"{copies} copies, aware={aware}")


@pytest.mark.mpi
@pytest.mark.parametrize("aware", [False, True])
def test_staged_steps_copy_each_bucket_once_each_way(comm, monkeypatch, aware):
    use_mode(monkeypatch, aware)
    params = [on_device(np.zeros(5)), on_device(np.zeros(7))]
    dp = DataParallel(params, comm=comm, bucket_cap_mb=1e-6)  # two buckets
    steps = 3
    with Join([dp]):
        Counters.reset()
        for _ in range(steps):
            with dp.step():
                for g in dp.grads:
                    g[...] = 1.0
    expected = (0, 0) if aware else (2 * steps, 2 * steps)
    copies = (Counters.d2h, Counters.h2d)
    # the Join's own heartbeats stay on the host: only buckets are copied
    assert_all(copies == expected, f"copies {copies} != {expected}")
    assert_all(all(np.all(g == 1.0) for g in dp.grads), "wrong average")


@pytest.mark.mpi
@pytest.mark.parametrize("aware", [False, True])
@pytest.mark.parametrize("copies", [False, True])
def test_zero_on_the_device_equals_the_host_run(comm, monkeypatch, aware, copies):
    """With copies, a move to another communicator (a re-shard) between two Joins too."""
    use_mode(monkeypatch, aware)

    def run(device):
        rng = np.random.default_rng(3)
        params = [device(rng.normal(size=n)) for n in (4, 6, 3, 5)]
        grads = [device(np.cos(np.arange(p.size) + i)) for i, p in enumerate(params)]
        zero = ZeroRedundancyOptimizer(params, grads, Adam, comm=comm, lr=0.1, copies=copies)
        with Join([zero], elastic=copies):
            for _ in range(2 + comm.rank):
                zero.step()
        if copies:
            other = comm.Dup()
            zero.move_to(other)
            with Join([zero], elastic=True):
                zero.step()
            other.Free()
        return params

    host, device = run(np.asarray), run(on_device)
    same = all(type(d) is FakeDeviceArray and np.array_equal(d, h) for d, h in zip(device, host))
    assert_all(same, "the device run left the host run")
