"""Refusals of torch tensors give torch's remedy, never NumPy's (a copy the model never reads)."""

import pytest

from tensorplay_mpi import DataParallel, JoinableComm
from tensorplay_mpi.comm import iallreduce
from tensorplay_mpi.testing import assert_all, raises_everywhere

torch = pytest.importorskip("torch")


def transposed():
    return torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.float64).t())


@pytest.mark.mpi(min_size=1)
def test_a_non_contiguous_parameter_is_refused_with_torchs_remedy(comm):
    with raises_everywhere(ValueError, match=r"p\.data = p\.data\.contiguous\(\)") as raised:
        DataParallel([transposed()], comm=comm)
    assert_all("numpy" not in str(raised.value), str(raised.value))


@pytest.mark.mpi(min_size=1)
def test_a_non_contiguous_tensor_to_a_collective_gets_torchs_remedy(comm):
    t = torch.zeros(4, 3).t()
    with raises_everywhere(ValueError, match=r"t\.contiguous\(\)") as raised:
        iallreduce(comm, t, torch.zeros(3, 4)).wait()
    assert_all("numpy" not in str(raised.value), str(raised.value))


@pytest.mark.mpi(min_size=1)
def test_a_non_contiguous_out_tensor_gets_torchs_remedy(comm):
    jc = JoinableComm(comm)
    with raises_everywhere(ValueError, match=r"out\.copy_\(result\)") as raised:
        jc.allreduce(torch.zeros(3, 4), out=torch.zeros(4, 3).t())
    assert_all("numpy" not in str(raised.value), str(raised.value))
