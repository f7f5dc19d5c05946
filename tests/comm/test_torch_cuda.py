"""torch CUDA tensors on one rank, through the CPU stand-in: views, streams, refusals."""

import sys

import numpy as np
import pytest
from mpi4py import MPI
from fake_device import (Counters, FakeCuda, FakeDeviceArray, TorchCounters, fake_cuda,
                         use_torch_cuda_standin)

from tensorplay_mpi.comm import iallreduce, _torch_cuda as torch_cuda
from tensorplay_mpi.comm._tensors import as_array, host_array, like

torch = pytest.importorskip("torch")


@pytest.fixture
def standin(monkeypatch):
    use_torch_cuda_standin(monkeypatch, aware=False)


def test_a_cuda_parameter_is_viewed_on_the_device_without_a_copy_and_wrapped_back(standin):
    p = fake_cuda(torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)))
    view = as_array(p)
    view[1] = 5.0
    assert type(view) is FakeDeviceArray and p[1].item() == 5.0  # a device array, shared
    back = like(p, view)
    assert isinstance(back, FakeCuda) and back.data_ptr() == p.data_ptr()
    assert torch_cuda.in_use()


def test_a_cuda_tensor_on_the_host_is_a_numpy_array(standin):
    host = host_array(fake_cuda(torch.arange(4, dtype=torch.float64)))
    assert type(host) is np.ndarray and host.tolist() == [0, 1, 2, 3]


def test_torch_stream_is_synchronised_before_mpi_and_waited_for_after_a_staged_copy(standin):
    x = fake_cuda(torch.ones(4, dtype=torch.float64))
    work = iallreduce(MPI.COMM_WORLD, x, x)
    synced_at_start = TorchCounters.stream_syncs
    work.wait()
    assert synced_at_start == 1, "torch's stream was not synchronised before MPI read the buffer"
    assert (Counters.d2h, Counters.h2d) == (1, 1), "staged: one copy each way"
    assert TorchCounters.hand_backs >= 1, "torch's stream does not wait for the copy back"
    assert x.tolist() == [1.0] * 4


def test_without_torch_cuda_tensors_torch_streams_are_left_alone(standin):
    x = np.ones(4)
    iallreduce(MPI.COMM_WORLD, x, x).wait()
    assert (TorchCounters.stream_syncs, TorchCounters.hand_backs) == (0, 0)
    assert not torch_cuda.in_use()


def test_a_cuda_tensor_without_cupy_names_the_package_to_install(monkeypatch):
    monkeypatch.setattr(torch_cuda, "_on_cuda", lambda tensor: isinstance(tensor, FakeCuda))
    monkeypatch.setitem(sys.modules, "cupy", None)  # the real view's `import cupy` fails
    with pytest.raises(TypeError, match=r"params\[0\] is a torch tensor on .*install the CuPy "
                                        r"wheel of your CUDA version"):
        as_array(fake_cuda(torch.zeros(2)), "params[0]")


def test_a_cuda_tensor_of_a_dtype_without_a_view_is_a_type_error(standin):
    with pytest.raises(TypeError, match="dtype torch.bfloat16 .* has no CuPy view"):
        as_array(fake_cuda(torch.zeros(2, dtype=torch.bfloat16)), "x")


def test_a_tensor_on_another_device_kind_is_refused():
    with pytest.raises(TypeError, match="on the CPU and on CUDA devices"):
        as_array(torch.zeros(2, device="meta"))


def test_handed_hands_torch_its_stream_back_when_the_block_raises(standin):
    as_array(fake_cuda(torch.zeros(2, dtype=torch.float64)))  # torch CUDA in use
    TorchCounters.reset()
    with pytest.raises(ZeroDivisionError, match="a bug between the two"):
        with torch_cuda.handed():
            raise ZeroDivisionError("a bug between the two")
    assert (TorchCounters.takes, TorchCounters.hand_backs) == (1, 1)


def test_an_optimizer_step_that_raises_still_hands_torch_its_stream_back(standin):
    """An update that fails after its take (a schedule's bug) leaves torch's stream ordered
    after the library's kernels, as a completed one does."""
    from tensorplay_mpi.optim import SGD

    param = fake_cuda(torch.zeros(3, dtype=torch.float64))
    opt = SGD([param], [fake_cuda(torch.ones(3, dtype=torch.float64))],
              lr=lambda step: 0.1 if step == 1 else 1 / 0)
    opt.step()
    TorchCounters.reset()
    with pytest.raises(ZeroDivisionError):
        opt.step()
    assert TorchCounters.takes >= 1 and TorchCounters.hand_backs == TorchCounters.takes
