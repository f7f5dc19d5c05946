"""PyTorch tensors and DLPack objects as arrays: zero-copy views, without importing torch.

MPI, the buckets and the update rules work on NumPy (or CuPy) arrays.  A torch CPU tensor,
a parameter included, is used through the NumPy view of its memory (``t.detach().numpy()``,
no copy); a torch CUDA tensor through the CuPy view of its memory (:mod:`.torch_cuda`); another
object that exports ``__dlpack__`` on the CPU through ``numpy.from_dlpack``.  What the library
hands back (``dp.grads``, a JoinableComm result) is of the kind the caller passed: :func:`like`
wraps an array back into a tensor, sharing its memory.

torch is looked up in ``sys.modules``, never imported: a program that holds a tensor has
imported torch, and ``import tensorplay_mpi`` stays free of it.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from . import _torch_cuda as torch_cuda

_DLPACK_CPU = 1  # kDLCPU


def is_tensor(x: Any) -> bool:
    """True for a ``torch.Tensor`` (``torch.nn.Parameter`` included)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def as_array(x: Any, name: str = "array", bits: bool = False) -> Any:
    """`x` as an array the library computes on, sharing its memory.

    NumPy and CuPy arrays, and objects with an array interface, come back unchanged.  A torch
    CPU tensor becomes ``x.detach().numpy()``; a torch CUDA tensor, the CuPy array sharing
    its memory; another object exporting ``__dlpack__`` on the CPU, ``numpy.from_dlpack(x)``.
    With `bits`, for callers that move values without computing on them (broadcasts, saves,
    DataParallel's buckets), a torch CPU bfloat16 tensor, which NumPy lacks, becomes the
    int16 view of its memory (:func:`bfloat16_bits`).

    Raises
    ------
    TypeError
        For a torch tensor on neither the CPU nor a CUDA device, a torch CUDA tensor without
        CuPy installed, or a tensor of a dtype that NumPy (CuPy) lacks (bfloat16, ...) or
        cannot view (conjugate bit set).
    """
    if type(x) is np.ndarray:
        return x
    if is_tensor(x):
        if torch_cuda.is_cuda_tensor(x):
            return torch_cuda.device_view(x, name)
        if x.device.type != "cpu":
            raise TypeError(f"{name} is a torch tensor on {x.device}: tensorplay_mpi takes torch "
                            "tensors on the CPU and on CUDA devices")
        if bits and is_bfloat16(x):
            return bfloat16_bits(x)
        try:
            return x.detach().numpy()
        except (TypeError, RuntimeError) as error:
            raise TypeError(f"{name}: a torch tensor of dtype {x.dtype} has no NumPy view "
                            f"({error})") from None
    if (hasattr(x, "__dlpack__") and not hasattr(x, "__array_interface__")
            and not hasattr(x, "__cuda_array_interface__")
            and getattr(x, "__dlpack_device__", lambda: (None, 0))()[0] == _DLPACK_CPU):
        return np.from_dlpack(x)
    return x


def is_bfloat16(x: Any) -> bool:
    """True for a torch tensor of dtype bfloat16."""
    return is_tensor(x) and x.dtype == sys.modules["torch"].bfloat16


def bfloat16_bits(x: Any) -> np.ndarray:
    """The int16 NumPy view of the memory of a torch CPU bfloat16 tensor `x` (no copy): its
    bits, which MPI moves and files store exactly; :func:`like` makes bfloat16 of it again."""
    return x.detach().view(sys.modules["torch"].int16).numpy()


def host_array(x: Any, name: str = "array", bits: bool = False) -> np.ndarray:
    """`x` as a NumPy array in host memory: a view where it is there (:func:`as_array`), a
    copy from a device (a torch CUDA tensor through ``.cpu()``, a CuPy array through
    ``.get()``), for the small results read on the host (metric states, statistics).

    Raises
    ------
    TypeError
        As :func:`as_array`.
    """
    if torch_cuda.is_cuda_tensor(x):
        x = x.detach().cpu()  # waits for torch's stream: the values are complete
    array = as_array(x, name, bits)
    if type(array) is not np.ndarray and callable(getattr(array, "get", None)):
        return array.get()
    return np.asarray(array)


def as_arrays(xs: Any, name: str, bits: bool = False) -> list[Any]:
    """:func:`as_array` of each of `xs` (``params[i]`` and so on, for `name` ``"params"``)."""
    return [as_array(x, f"{name}[{i}]", bits) for i, x in enumerate(xs)]


def like(template: Any, array: Any) -> Any:
    """`array` as the kind of `template`: a torch tensor sharing its memory when `template`
    is one (on the CPU or on a CUDA device, as `array`; bfloat16 from the bits of a
    bfloat16 `template`), else `array` itself."""
    if type(template) is not np.ndarray and is_tensor(template):
        if torch_cuda.is_cuda_tensor(template):
            return torch_cuda.tensor_view(array)
        torch = sys.modules["torch"]
        tensor = torch.from_numpy(array)
        return tensor.view(torch.bfloat16) if template.dtype == torch.bfloat16 else tensor
    return array
