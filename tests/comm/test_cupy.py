"""CuPy arrays on a real GPU (``make gpu-check``); skipped where there is no GPU and CuPy."""

import numpy as np
import pytest
from helpers import UNEVEN
from linear import make_problem, train
from mpi4py import MPI

from tensorplay_mpi import (SGD, Adam, AdamW, DataParallel, Join, JoinableComm,
                            ZeroRedundancyOptimizer)
from tensorplay_mpi.comm import _buffers as buffers
from tensorplay_mpi.testing import assert_all, inputs_of, reset_settings

cupy = pytest.importorskip("cupy")
try:
    HAS_GPU = cupy.cuda.runtime.getDeviceCount() > 0
except cupy.cuda.runtime.CUDARuntimeError:
    HAS_GPU = False
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU")]

MODES = {"staged": "0", "detected": "auto"}


def set_mode(monkeypatch, mode):
    monkeypatch.setenv("TENSORPLAY_MPI_CUDA_AWARE", MODES[mode])
    reset_settings()


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pattern", UNEVEN)
def test_data_parallel_with_cupy_equals_the_host_run(comm, monkeypatch, mode, pattern):
    set_mode(monkeypatch, mode)
    data, inputs = make_problem(), inputs_of(pattern, comm.size)
    expected, _ = train(comm, data, inputs, bucket_cap_mb=1e-6)
    params, dp = train(comm, data, inputs, bucket_cap_mb=1e-6, device=cupy.asarray)
    assert_all(dp.join_device.startswith("cuda"), dp.join_device)
    close = all(np.allclose(cupy.asnumpy(p), e, rtol=1e-12, atol=1e-14)
                for p, e in zip(params, expected))
    assert_all(close, "the GPU run left the host run")


class StreamSpy(MPI.Intracomm):
    """The same communicator; records, at each Iallreduce, whether `stream` had finished."""

    stream: "cupy.cuda.Stream"
    done_at_start: list[bool]

    def Iallreduce(self, *args, **kwargs):
        self.done_at_start.append(self.stream.done)
        return super().Iallreduce(*args, **kwargs)


@pytest.mark.mpi
def test_a_gradient_written_on_another_stream_is_synchronised(comm):
    """Only CUDA-aware MPI reads device memory unordered with the stream: staging copies on the
    current stream and waits for the copy, so there a missing sync could not show."""
    if not buffers.cuda_aware()[0]:
        pytest.skip("the MPI library is not CUDA-aware")
    stream = cupy.cuda.Stream(non_blocking=True)
    spy = StreamSpy(comm)
    spy.stream, spy.done_at_start = stream, []
    params = [cupy.zeros(1 << 24, cupy.float32)]
    dp = DataParallel(params, comm=spy)
    with Join([dp]):
        with stream:  # the library synchronises the current stream before MPI
            with dp.step():
                for _ in range(20):  # keep the stream busy well past the call into MPI
                    cupy.sin(dp.grads[0], out=dp.grads[0])
                dp.grads[0].fill(comm.rank + 1.0)
    expected = sum(r + 1.0 for r in range(comm.size)) / comm.size
    assert_all(spy.done_at_start and all(spy.done_at_start), f"{spy.done_at_start}")
    assert_all(bool(cupy.all(dp.grads[0] == expected)), "a stale gradient reached MPI")


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
def test_zero_with_cupy_equals_the_host_run(comm, monkeypatch, mode):
    set_mode(monkeypatch, mode)

    def run(xp):
        rng = np.random.default_rng(3)
        params = [xp.asarray(rng.normal(size=n)) for n in (4, 6, 3, 5)]
        grads = [xp.asarray(np.cos(np.arange(p.size) + i)) for i, p in enumerate(params)]
        zero = ZeroRedundancyOptimizer(params, grads, Adam, comm=comm, lr=0.1)
        with Join([zero]):
            for _ in range(2 + comm.rank):
                zero.step()
        return [cupy.asnumpy(p) if xp is cupy else p for p in params]

    close = all(np.allclose(d, h, rtol=1e-12) for d, h in zip(run(cupy), run(np)))
    assert_all(close, "the GPU run left the host run")


OPTIMIZERS = {"SGD": (SGD, {"lr": 0.1}),
              "SGD nesterov": (SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True,
                                     "weight_decay": 0.01}),
              "Adam": (Adam, {"lr": 0.05}),
              "AdamW": (AdamW, {"lr": 0.05, "weight_decay": 0.1})}


@pytest.mark.mpi
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_local_optimizers_on_cupy_equal_the_host_run(comm, name):
    """DataParallel + a local optimizer (its CuPy kernels) with uneven inputs, against NumPy."""
    cls, hyper = OPTIMIZERS[name]
    inputs = inputs_of("three_plus_rank", comm.size)

    def run(xp):
        rng = np.random.default_rng(5)
        params = [xp.asarray(rng.normal(size=n)) for n in (7, 3, 12)]
        dp = DataParallel(params, comm=comm, bucket_cap_mb=1e-6)
        opt = cls(params, dp.grads, **hyper)
        with Join([dp, opt]):
            for t in range(inputs[comm.rank]):
                with dp.step():
                    for i, g in enumerate(dp.grads):
                        g[...] = xp.asarray(np.sin(np.arange(g.size) + i + t + comm.rank))
                opt.step()
        return [cupy.asnumpy(p) if xp is cupy else p for p in params]

    close = all(np.allclose(d, h, rtol=1e-12, atol=1e-15) for d, h in zip(run(cupy), run(np)))
    assert_all(close, f"{name}: the GPU run left the host run")


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pattern", UNEVEN)
def test_joinable_comm_on_cupy_equals_the_host_run(comm, monkeypatch, mode, pattern):
    """allreduce (small: announced or persistent paths; large), bcast and allgather of CuPy
    arrays with joined ranks: bitwise the NumPy results, returned as CuPy arrays."""
    set_mode(monkeypatch, mode)
    inputs = inputs_of(pattern, comm.size)

    def run(xp):
        jc, results, kinds = JoinableComm(comm), [], set()
        with Join([jc]):
            for t in range(inputs[comm.rank]):
                jc.begin_iteration()
                for got in (jc.allreduce(xp.arange(5.0) + comm.rank + t),
                            jc.allreduce(xp.full(1 << 16, comm.rank + t, xp.float32), MPI.MAX),
                            jc.bcast(xp.full(3, comm.rank + t), root="highest_active"),
                            jc.allgather(xp.full((comm.rank % 2 + 1, 2), comm.rank + t))):
                    kinds.add(type(got))
                    results.append(cupy.asnumpy(got) if xp is cupy else got)
        return results, kinds

    (device, kinds), (host, _) = run(cupy), run(np)
    same = len(device) == len(host) and all(np.array_equal(d, h) for d, h in zip(device, host))
    assert_all(same and kinds <= {cupy.ndarray}, f"results differ or not CuPy arrays: {kinds}")
