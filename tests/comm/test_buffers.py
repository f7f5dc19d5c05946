"""Devices, CUDA-awareness and host staging on one rank, driven by a fake device array."""

import subprocess
import sys

import numpy as np
import pytest
from fake_device import Counters, FakeDeviceArray, on_device, use_mode
from mpi4py import MPI

from tensorplay_mpi import DataParallel
from tensorplay_mpi.comm import _buffers as buffers
from tensorplay_mpi.comm import iallreduce, ibcast
from tensorplay_mpi.testing import reset_settings


RECORD_IMPORTS = """
import importlib.abc, pkgutil, sys
SKIPPED = NOT_RECORDED
tried = []
class Recorder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "MODULE":
            tried.append(name)
        return None
sys.meta_path.insert(0, Recorder())
import tensorplay_mpi
for module in pkgutil.walk_packages(tensorplay_mpi.__path__, "tensorplay_mpi."):
    if ".examples." not in module.name and module.name not in SKIPPED:
        __import__(module.name)
print("library", tried)
try:
    import MODULE
except ImportError:
    pass
print("then", tried)
"""


@pytest.mark.parametrize("module", ["cupy", "torch"])
def test_importing_the_library_never_tries_to_import_cupy_or_torch(module):
    """Import attempts are recorded, so this fails whether the module is installed or not."""
    # _sync_batchnorm subclasses a torch module: torch-only by design, imported on first use of
    # tensorplay_mpi.SyncBatchNorm (the test below)
    skipped = {"tensorplay_mpi.evaluation._sync_batchnorm"} if module == "torch" else set()
    program = RECORD_IMPORTS.replace("MODULE", module).replace("NOT_RECORDED", repr(skipped))
    result = subprocess.run([sys.executable, "-c", program],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    library, then = result.stdout.splitlines()
    assert library == "library []"
    assert then.startswith(f"then ['{module}'")  # the recorder sees an attempt


def _printed_by(program):
    """The lines a fresh interpreter prints running `program` (it must exit 0)."""
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_sync_batchnorm_is_imported_only_on_first_use():
    pytest.importorskip("torch")
    assert _printed_by(
        "import sys, tensorplay_mpi\n"
        "print(sorted(m for m in ('torch', 'tensorplay_mpi.evaluation._sync_batchnorm') "
        "if m in sys.modules))\n"
        "import torch\n"
        "print(issubclass(tensorplay_mpi.SyncBatchNorm, torch.nn.Module))\n") == ["[]", "True"]


def test_a_star_import_without_torch_works_and_sync_batchnorm_says_what_it_needs():
    lines = _printed_by("import sys\n"
                        "sys.modules['torch'] = None  # as if torch were not installed\n"
                        "from tensorplay_mpi import *\n"
                        "import tensorplay_mpi\n"
                        "print('SyncBatchNorm' in dir(tensorplay_mpi))\n"
                        "try:\n"
                        "    SyncBatchNorm.convert_sync_batchnorm(None)\n"
                        "except ImportError as error:\n"
                        "    print(error)\n")
    assert lines[0] == "True" and "tensorplay-mpi[torch]" in lines[1], lines


class OnlyCudaInterface:
    __cuda_array_interface__ = {"shape": (1,), "typestr": "<f8", "data": (0, False),
                                "version": 3}


def test_devices_are_recognised_without_cupy():
    assert buffers.device_of(np.zeros(2)) == "cpu"
    assert buffers.device_of(on_device(np.zeros(2))) == "cuda:0"
    assert buffers.device_of(OnlyCudaInterface()) == "cuda"
    assert not buffers.is_device_array(np.zeros(2))
    assert buffers.is_device_array(on_device(np.zeros(2)))


@pytest.mark.parametrize("setting, aware", [("1", True), ("0", False), ("auto", False)])
def test_cuda_aware_setting(monkeypatch, setting, aware):
    monkeypatch.setenv("TENSORPLAY_MPI_CUDA_AWARE", setting)
    reset_settings()
    decision, why = buffers.cuda_aware()
    assert decision is aware and why
    if setting == "auto":  # the PyPI MPICH wheel is built without CUDA
        assert "reports no CUDA support" in why


def test_a_bad_cuda_aware_setting_is_a_value_error(monkeypatch):
    monkeypatch.setenv("TENSORPLAY_MPI_CUDA_AWARE", "maybe")
    reset_settings()
    with pytest.raises(ValueError, match="TENSORPLAY_MPI_CUDA_AWARE must be one of auto, 0, 1, "
                                         "got 'maybe'"):
        buffers.cuda_aware()


def test_staging_copies_in_and_back_once_per_operation(monkeypatch):
    use_mode(monkeypatch, aware=False)
    device = on_device(np.arange(4.0))
    for _ in range(3):
        iallreduce(MPI.COMM_SELF, MPI.IN_PLACE, device).wait()
    assert (Counters.syncs, Counters.d2h, Counters.h2d) == (3, 3, 3)
    np.testing.assert_array_equal(device, np.arange(4.0))


def test_concurrent_operations_on_device_arrays_stage_through_their_own_buffers(monkeypatch):
    use_mode(monkeypatch, aware=False)
    first, second = on_device(np.zeros(3)), on_device(np.full(3, 7.0))
    writes = iallreduce(MPI.COMM_SELF, np.ones(3), first)  # copied back to `first` at wait
    reads = iallreduce(MPI.COMM_SELF, np.full(3, 2.0), second)
    reads.wait()
    writes.wait()
    np.testing.assert_array_equal(first, np.ones(3))
    np.testing.assert_array_equal(second, np.full(3, 2.0))


def test_allreduce_is_in_place_on_every_rank_whatever_the_caller_passes(monkeypatch):
    """Open MPI 5.0's libnbc mismatches ranks passing MPI_IN_PLACE with ranks passing a send
    buffer: the library copies a send buffer into the receive buffer and goes in place."""
    calls = []

    class Spy(MPI.Intracomm):
        def Iallreduce(self, send, recv, op):  # noqa: N802  (mpi4py's name)
            calls.append(send)
            return super().Iallreduce(send, recv, op)

    recv = np.zeros(3)
    iallreduce(Spy(MPI.COMM_SELF), np.arange(3.0), recv).wait()
    assert calls == [MPI.IN_PLACE]
    np.testing.assert_array_equal(recv, np.arange(3.0))
    with pytest.raises(TypeError, match="int64"):
        iallreduce(MPI.COMM_SELF, np.arange(3), recv)


def test_staging_a_device_array_without_get_and_set_is_a_type_error(monkeypatch):
    use_mode(monkeypatch, aware=False)

    class Bare(FakeDeviceArray):
        get = set = None

    with pytest.raises(TypeError, match="needs CuPy's get\\(\\)/set\\(\\)"):
        iallreduce(MPI.COMM_SELF, MPI.IN_PLACE, np.zeros(2).view(Bare))


def test_staging_copies_back_only_when_the_operation_completes(monkeypatch):
    use_mode(monkeypatch, aware=False)
    device = on_device(np.zeros(3))
    work = ibcast(MPI.COMM_SELF, device, root=0)
    work.wait()
    assert Counters.d2h == 1 and Counters.h2d == 0  # the root only sends
    received = on_device(np.zeros(2))
    iallreduce(MPI.COMM_SELF, np.ones(2), received).wait()
    assert Counters.h2d == 1 and received.tolist() == [1.0, 1.0]


def test_cuda_aware_mode_hands_device_buffers_to_mpi(monkeypatch):
    use_mode(monkeypatch, aware=True)
    device = on_device(np.arange(3.0))
    iallreduce(MPI.COMM_SELF, MPI.IN_PLACE, device).wait()
    assert (Counters.syncs, Counters.d2h, Counters.h2d) == (1, 0, 0)


def test_data_parallel_keeps_buckets_on_the_device(monkeypatch):
    use_mode(monkeypatch, aware=False)
    params = [on_device(np.zeros((2, 2))), on_device(np.zeros(3))]
    dp = DataParallel(params, comm=MPI.COMM_SELF)
    assert dp.join_device == "cuda:0"
    assert all(type(g) is FakeDeviceArray for g in dp.grads)


def test_params_on_two_devices_are_a_value_error():
    with pytest.raises(ValueError, match=r"one device, got \[0\] on cpu, \[1\] on cuda:0"):
        DataParallel([np.zeros(2), on_device(np.zeros(2))], comm=MPI.COMM_SELF)

