"""Host memory posing as CUDA device memory, to drive the GPU code paths on a CPU.

As in mpi4py's own test suite: the array exposes ``__cuda_array_interface__`` (and a CUDA DLPack
device) over host memory, so MPI can read and write it directly, as CUDA-aware MPI would.  It
counts what the library does to it: stream synchronisations (through the patched
``synchronize_stream``), device-to-host and host-to-device copies (CuPy's ``get``/``set``).
"""

import numpy as np

from tensorplay_mpi.comm import buffers
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

