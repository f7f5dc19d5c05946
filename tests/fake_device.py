"""Host memory posing as CUDA device memory, to drive the GPU code paths on a CPU.

As in mpi4py's own test suite: the array exposes ``__cuda_array_interface__`` (and a CUDA DLPack
device) over host memory, so MPI can read and write it directly, as CUDA-aware MPI would.  It
counts what the library does to it: stream synchronisations (through the patched
``synchronize_stream``), device-to-host and host-to-device copies (CuPy's ``get``/``set``).
"""

import numpy as np

from tensorplay_mpi.comm import _buffers as buffers
from tensorplay_mpi.testing import reset_settings

STREAM = 0x5EED  # the fake stream every fake array says it was produced on


class Counters:
    syncs = d2h = h2d = 0

    @classmethod
    def reset(cls):
        cls.syncs = cls.d2h = cls.h2d = 0


class FakeDeviceArray(np.ndarray):
    """An ndarray whose data the library must treat as living on ``cuda:0``."""

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "version": 3,
                "data": (self.ctypes.data, False), "strides": None, "stream": STREAM}

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA, device 0

    def get(self, out=None):
        Counters.d2h += 1
        out = np.empty(self.shape, self.dtype) if out is None else out
        np.copyto(out, self.view(np.ndarray))
        return out

    def set(self, host):
        Counters.h2d += 1
        np.copyto(self.view(np.ndarray), host)


def on_device(array):
    """A fake device copy of `array`."""
    return np.array(array).view(FakeDeviceArray)


def count_sync(stream):
    assert stream == STREAM, f"synchronised stream {stream!r}, not the array's"
    Counters.syncs += 1


def use_mode(monkeypatch, aware):
    """Make the library take the CUDA-aware (True) or host-staging (False) path."""
    monkeypatch.setenv("TENSORPLAY_MPI_CUDA_AWARE", "1" if aware else "0")
    reset_settings()
    monkeypatch.setattr(buffers, "synchronize_stream", count_sync)
    Counters.reset()



# -- torch CUDA tensors, stood in for by CPU tensors ------------------------------------------

class TorchCounters:
    stream_syncs = takes = hand_backs = 0

    @classmethod
    def reset(cls):
        cls.stream_syncs = cls.takes = cls.hand_backs = 0


class FakeCuda:
    """The mark of a stand-in CUDA tensor; `index` is its device's."""

    index = 0


def _fake_cuda_class(base, index):
    """A subclass of torch class `base` marking its tensors as on ``cuda:index`` (for the
    library only: torch still sees CPU tensors, its operations give plain tensors)."""
    import torch

    return type(f"FakeCuda{index}{base.__name__}", (base, FakeCuda), {
        "__torch_function__": torch._C._disabled_torch_function_impl, "index": index})


def is_on_device(tensor):
    """Whether `tensor` is on a CUDA device: really, or as a stand-in."""
    return isinstance(tensor, FakeCuda) or tensor.is_cuda


def fake_cuda(x, index=0):
    """`x` (a torch module, tensor or parameter) "moved" to ``cuda:index``: the same memory on
    the CPU, its tensors of a class that the library takes for CUDA tensors."""
    import torch

    if isinstance(x, torch.nn.Module):
        for t in [*x.parameters(), *x.buffers()]:
            fake_cuda(t, index)
        return x
    base = torch.nn.Parameter if isinstance(x, torch.nn.Parameter) else torch.Tensor
    x.__class__ = _FAKE_CLASSES.setdefault((base, index), _fake_cuda_class(base, index))
    return x


_FAKE_CLASSES = {}


class FakeDeviceArray1(FakeDeviceArray):
    def __dlpack_device__(self):
        return (2, 1)  # kDLCUDA, device 1


def use_torch_cuda_standin(monkeypatch, aware=True):
    """Make :mod:`tensorplay_mpi.comm._torch_cuda` take fake CUDA tensors (:func:`fake_cuda`):
    their "CuPy" views are :class:`FakeDeviceArray` s over the same memory (a host array comes
    back as a CPU tensor, as from torch), torch's stream synchronisations and the orderings
    of the two streams are counted; the device path is CUDA-aware (`aware`) or
    staged, as :func:`use_mode`."""
    import torch

    from tensorplay_mpi.comm import _torch_cuda as torch_cuda

    def to_device_array(tensor):
        array = tensor.detach().numpy()  # the CPU memory behind the stand-in
        return array.view(FakeDeviceArray1 if tensor.index == 1 else FakeDeviceArray)

    def to_tensor(array):
        if type(array) is np.ndarray:  # host memory: what torch.from_dlpack gives for it
            return torch.from_numpy(array)
        index = array.__dlpack_device__()[1]
        return fake_cuda(torch.from_numpy(array.view(np.ndarray)), index)

    def sync(device):
        TorchCounters.stream_syncs += 1

    def order(device, torch_first):
        if torch_first:
            TorchCounters.takes += 1
        else:
            TorchCounters.hand_backs += 1

    use_mode(monkeypatch, aware)
    monkeypatch.setattr(torch_cuda, "_on_cuda", lambda tensor: isinstance(tensor, FakeCuda))
    monkeypatch.setattr(torch_cuda, "_cupy_from_torch", to_device_array)
    monkeypatch.setattr(torch_cuda, "_torch_from_cupy", to_tensor)
    monkeypatch.setattr(torch_cuda, "_synchronize_torch_stream", sync)
    monkeypatch.setattr(torch_cuda, "_order", order)
    monkeypatch.setattr(torch_cuda, "_devices", set())
    TorchCounters.reset()
