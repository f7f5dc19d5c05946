"""torch CUDA tensors on the device path: CuPy views through DLPack, ordered with torch's stream.

A torch CUDA tensor is used through the CuPy array that shares its memory
(``cupy.from_dlpack(t.detach())``), so it takes the path of CuPy arrays: CUDA-aware MPI or host
staging, the fused update kernels.  What the library hands back for it (``dp.grads``, a
JoinableComm result) is the torch tensor sharing the CuPy array's memory (``torch.from_dlpack``).
Neither direction copies.

Streams.  torch computes on its current stream, the library's kernels run on CuPy's current
stream; in a program that chooses no stream both are the CUDA default stream.  Once a torch
CUDA tensor has been given to the library:

- before MPI touches a device buffer, torch's current stream on that device is synchronised
  (as CuPy's is): a gradient that backward() is still writing is never sent;
- when a library call hands device memory back (a step's end, a completed operation), torch's
  current stream is made to wait for CuPy's (an event, no host wait; nothing when they are
  the same stream): torch's next kernel sees what the library wrote.

torch and CuPy are looked up in ``sys.modules`` (a program holding a torch CUDA tensor has
imported torch); CuPy is imported on the first torch CUDA tensor, and its absence is a
``TypeError`` naming the package to install.  The four functions that touch CUDA are
module-level so that the CPU tests can put a stand-in in their place, with the one that says
whether a tensor is on a CUDA device.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["is_cuda_tensor", "device_view", "tensor_view", "synchronize", "hand_back", "in_use"]

MISSING_CUPY = ("tensorplay_mpi carries torch CUDA tensors through CuPy (zero-copy DLPack "
                "views): install the CuPy wheel of your CUDA version (pip install "
                "cupy-cuda12x, or tensorplay-mpi[cuda])")


_devices: set[int] = set()  # those of the torch CUDA tensors given to the library so far


def in_use() -> bool:
    """Whether a torch CUDA tensor has been given to the library in this process."""
    return bool(_devices)


def is_cuda_tensor(x: Any) -> bool:
    """True for a torch tensor on a CUDA device."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor) and _on_cuda(x)


def device_view(tensor: Any, name: str = "tensor") -> Any:
    """The CuPy array sharing the memory of torch CUDA tensor `tensor` (no copy).

    Raises
    ------
    TypeError
        If CuPy is not installed, or DLPack cannot export the tensor (its dtype, a
        conjugate bit).
    """
    try:
        view = _cupy_from_torch(tensor)
    except ImportError:
        raise TypeError(f"{name} is a torch tensor on {tensor.device}: {MISSING_CUPY}") from None
    except (TypeError, RuntimeError, BufferError) as error:
        raise TypeError(f"{name}: a torch tensor of dtype {tensor.dtype} on {tensor.device} "
                        f"has no CuPy view ({error})") from None
    _devices.add(tensor.get_device())
    return view


def tensor_view(array: Any) -> Any:
    """The torch CUDA tensor sharing the memory of CuPy array `array` (no copy)."""
    return _torch_from_cupy(array)


def synchronize(device: int) -> None:
    """Wait for torch's current stream on CUDA device `device`, once torch CUDA is in use."""
    if _devices:
        _synchronize_torch_stream(device)


def hand_back() -> None:
    """Order torch's current stream after CuPy's, once torch CUDA is in use: torch's next
    kernels see what the library's kernels and copies wrote."""
    if _devices:
        _order_torch_after_cupy()


# -- what touches CUDA (the CPU tests replace these) ---------------------------------------------

def _on_cuda(tensor: Any) -> bool:
    return bool(tensor.is_cuda)


def _cupy_from_torch(tensor: Any) -> Any:
    import cupy

    return cupy.from_dlpack(tensor.detach())


def _torch_from_cupy(array: Any) -> Any:
    return sys.modules["torch"].from_dlpack(array)


def _synchronize_torch_stream(device: int) -> None:
    sys.modules["torch"].cuda.current_stream(device).synchronize()


def _order_torch_after_cupy() -> None:
    torch, cupy = sys.modules["torch"], sys.modules["cupy"]
    ours = cupy.cuda.get_current_stream()
    theirs = torch.cuda.current_stream()
    if theirs.cuda_stream != ours.ptr:
        theirs.wait_stream(torch.cuda.ExternalStream(ours.ptr))
