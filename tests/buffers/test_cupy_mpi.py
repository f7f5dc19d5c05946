"""CuPy arrays on a real GPU (``make gpu-check``); skipped where there is no GPU and CuPy."""

import numpy as np
import pytest
from helpers import UNEVEN
from linear import make_problem, train
from mpi4py import MPI

from tensorplay_mpi import Adam, Join, ZeroRedundancyOptimizer, buffers
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
    from tensorplay_mpi import DataParallel

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
