"""torch tensors and DLPack exporters on one rank: zero-copy views, kinds handed back, refusals."""

import numpy as np
import pytest
from mpi4py import MPI

from tensorplay_mpi import Adam, DataParallel, JoinableComm
from tensorplay_mpi.comm import iallreduce, ibcast
from tensorplay_mpi.comm._tensors import as_array, like

torch = pytest.importorskip("torch")


class DLPackOnly:
    """An array that exports only DLPack (no array interface): what a third library hands."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_a_parameter_is_viewed_without_a_copy_and_wrapped_back():
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    view = as_array(p)
    view[1] = 5.0
    assert isinstance(view, np.ndarray) and p[1].item() == 5.0
    back = like(p, view)
    assert isinstance(back, torch.Tensor) and back.data_ptr() == p.data_ptr()
    assert like(np.zeros(1), view) is view


def test_tensors_without_a_numpy_view_are_a_type_error_everywhere():
    tensor = torch.zeros(2, device="meta")
    match = ("torch tensor on meta: tensorplay_mpi takes torch tensors on the CPU and on CUDA "
             "devices")
    with pytest.raises(TypeError, match=match):
        DataParallel([tensor], comm=MPI.COMM_SELF)
    with pytest.raises(TypeError, match=match):
        iallreduce(MPI.COMM_SELF, tensor, tensor)
    with pytest.raises(TypeError, match=match):
        JoinableComm(MPI.COMM_SELF).allreduce(tensor)
    with pytest.raises(TypeError, match=match):
        Adam([tensor], [tensor])


def test_bfloat16_is_refused_where_it_would_be_computed_on():
    """A bfloat16 tensor's int16 view would sum as integers: collectives and the library's
    optimizers refuse it (DataParallel reduces it through float32: tests/parallel/test_half)."""
    tensor = torch.zeros(2, dtype=torch.bfloat16)
    match = "dtype torch.bfloat16 has no NumPy view"
    with pytest.raises(TypeError, match=match):
        iallreduce(MPI.COMM_SELF, tensor, tensor)
    with pytest.raises(TypeError, match=match):
        JoinableComm(MPI.COMM_SELF).allreduce(tensor)
    with pytest.raises(TypeError, match="params\\[0\\] is bfloat16, which NumPy lacks"):
        Adam([tensor], [tensor])


def test_one_tensor_instead_of_a_sequence_is_a_type_error():
    with pytest.raises(TypeError, match=r"pass a sequence of arrays \(got one Parameter"):
        DataParallel(torch.nn.Parameter(torch.zeros(2)), comm=MPI.COMM_SELF)


def test_a_model_with_a_live_data_parallel_is_refused_until_it_is_gone():
    model = torch.nn.Linear(3, 2)
    dp = DataParallel(model.parameters(), comm=MPI.COMM_SELF)
    with pytest.raises(ValueError, match=r"params\[0\] already has its gradient bound"):
        DataParallel(model.parameters(), comm=MPI.COMM_SELF)
    del dp
    DataParallel(model.parameters(), comm=MPI.COMM_SELF)


def test_comm_functions_write_into_dlpack_exporters_without_copies():
    data = np.arange(4.0)
    exporter = DLPackOnly(data)
    work = iallreduce(MPI.COMM_SELF, MPI.IN_PLACE, exporter)
    assert work.wait() and work.result() is exporter
    out = DLPackOnly(np.zeros(4))
    iallreduce(MPI.COMM_SELF, exporter, out).wait()
    ibcast(MPI.COMM_SELF, exporter, 0).wait()
    np.testing.assert_array_equal(out.array, data)
    tensor = torch.ones(2, requires_grad=True)  # a parameter-like tensor needs no detach()
    work = iallreduce(MPI.COMM_SELF, MPI.IN_PLACE, tensor)
    assert work.wait() and work.result() is tensor


def test_joinable_comm_hands_back_tensors_and_writes_out_in_place():
    jc = JoinableComm(MPI.COMM_SELF)
    x = torch.arange(3.0)
    total = jc.allreduce(x)
    assert isinstance(total, torch.Tensor) and total.tolist() == [0.0, 1.0, 2.0]
    assert jc.allreduce(x, out=x) is x
    assert isinstance(jc.allgather(x.reshape(3, 1)), torch.Tensor)
    assert jc.bcast(DLPackOnly(np.ones(2)), root=0).tolist() == [1.0, 1.0]


def test_dp_grads_are_tensors_bound_to_the_parameters_and_the_buckets():
    model = torch.nn.Linear(3, 2)
    dp = DataParallel(model.parameters(), comm=MPI.COMM_SELF)
    assert all(isinstance(g, torch.Tensor) and p.grad is g
               for p, g in zip(model.parameters(), dp.grads))
    dp.grads[1] = np.ones(2)  # a gradient written through the views lands in p.grad
    assert model.bias.grad.tolist() == [1.0, 1.0]
    model.zero_grad()  # unbinds: the next step binds again, from zero
    with dp.step():
        model(torch.ones(1, 3)).sum().backward()
    assert model.bias.grad is dp.grads[1] and model.bias.grad.tolist() == [1.0, 1.0]
