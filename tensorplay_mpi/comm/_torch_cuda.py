"""torch CUDA tensors on the device path: CuPy views through DLPack, ordered with torch's stream.

A torch CUDA tensor is used through the CuPy array that shares its memory
(``cupy.from_dlpack(t.detach())``), so it takes the path of CuPy arrays: CUDA-aware MPI or host
staging, the fused update kernels.  What the library hands back for it (``dp.grads``, a
JoinableComm result) is the torch tensor sharing the CuPy array's memory (``torch.from_dlpack``).
Neither direction copies.

Devices.  CuPy allocates and runs on its current device: the first view of a tensor makes the
tensor's device CuPy's current one (a program that calls only ``torch.cuda.set_device`` gets
its buckets on that GPU, not on GPU 0).

Streams.  torch computes on its current stream, the library's kernels run on CuPy's current
stream; in a program that chooses no stream both are the CUDA default stream.  Once a torch
CUDA tensor has been given to the library:

- before MPI touches a device buffer, torch's current stream on that device is synchronised
  (as CuPy's is): a gradient that backward() is still writing is never sent;
- before a library kernel reads what torch wrote outside that path (an optimizer's update, a
  checkpoint load, a per-sample weighting), CuPy's stream is made to wait for torch's
  (:func:`take`);
- when a library call hands device memory back (a step's end, a completed operation, an
  optimizer step, a load), torch's current stream is made to wait for CuPy's
  (:func:`hand_back`).

A call that does both, its kernels between torch's, runs them inside ``with handed():``, which
takes on entry and hands back on exit, an exception included.

Both are events, without a host wait, and nothing when the two are the same stream.

torch and CuPy are looked up in ``sys.modules`` (a program holding a torch CUDA tensor has
imported torch); CuPy is imported on the first torch CUDA tensor, and its absence is a
``TypeError`` naming the package to install.  The functions that touch CUDA (the last ones
below) are module-level so that the CPU tests can put a stand-in in their place, with the one
that says whether a tensor is on a CUDA device.
"""

from __future__ import annotations

import sys
from typing import Any

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


def take() -> None:
    """Order CuPy's current stream after torch's on each device in use: the library's next
    kernels see what torch's wrote."""
    for device in _devices:
        _order(device, torch_first=True)


def hand_back() -> None:
    """Order torch's current stream after CuPy's on each device in use: torch's next
    kernels see what the library's kernels and copies wrote."""
    for device in _devices:
        _order(device, torch_first=False)


class _Handed:
    """:func:`take` on entry, :func:`hand_back` on exit (a class: no generator per use)."""

    __slots__ = ()

    def __enter__(self) -> None:
        take()

    def __exit__(self, *exc_info: Any) -> None:
        hand_back()


_HANDED = _Handed()


def handed() -> _Handed:
    """The library's kernels between torch's: ``with handed():`` takes (:func:`take`) on
    entry and hands back (:func:`hand_back`) on exit, an exception included."""
    return _HANDED


# -- what touches CUDA (the CPU tests replace these) ---------------------------------------------

def _on_cuda(tensor: Any) -> bool:
    return bool(tensor.is_cuda)


def _cupy_from_torch(tensor: Any) -> Any:
    import cupy

    if not _devices:  # the first tensor: the library's kernels on its GPU from now on
        cupy.cuda.Device(tensor.get_device()).use()
    return cupy.from_dlpack(tensor.detach())


def _torch_from_cupy(array: Any) -> Any:
    return sys.modules["torch"].from_dlpack(array)


def _synchronize_torch_stream(device: int) -> None:
    sys.modules["torch"].cuda.current_stream(device).synchronize()


def _order(device: int, torch_first: bool) -> None:
    """On `device`: CuPy's current stream waits for torch's (`torch_first`), or the reverse."""
    torch, cupy = sys.modules["torch"], sys.modules["cupy"]
    with cupy.cuda.Device(device):
        ours = cupy.cuda.get_current_stream()
    theirs = torch.cuda.current_stream(device)
    if theirs.cuda_stream == ours.ptr:
        return
    ours_in_torch = torch.cuda.ExternalStream(ours.ptr, device=device)
    if torch_first:
        ours_in_torch.wait_stream(theirs)
    else:
        theirs.wait_stream(ours_in_torch)
