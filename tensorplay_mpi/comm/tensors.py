"""PyTorch tensors and DLPack objects as arrays: zero-copy NumPy views, without importing torch.

MPI, the buckets and the update rules work on NumPy (or CuPy) arrays.  A torch CPU tensor,
a parameter included, is used through the NumPy view of its memory (``t.detach().numpy()``,
no copy); another object that exports ``__dlpack__`` on the CPU through
``numpy.from_dlpack``.  What the library hands back (``dp.grads``, a JoinableComm result) is
of the kind the caller passed: :func:`like` wraps a NumPy array back into a tensor, sharing
its memory.

torch is looked up in ``sys.modules``, never imported: a program that holds a tensor has
imported torch, and ``import tensorplay_mpi`` stays free of it.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["JOIN_CHECK", "as_array", "as_arrays", "is_tensor", "like"]

_DLPACK_CPU = 1  # kDLCPU

JOIN_CHECK = "_tensorplay_join_check"
"""The attribute a layer sets on its parameters (SyncBatchNorm: a callable taking a Join) that
a DataParallel over them calls when a Join is made with it."""


def is_tensor(x: Any) -> bool:
    """True for a ``torch.Tensor`` (``torch.nn.Parameter`` included)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def as_array(x: Any, name: str = "array") -> Any:
    """`x` as an array the library computes on, sharing its memory.

    NumPy and CuPy arrays, and objects with an array interface, come back unchanged.  A torch
    CPU tensor becomes ``x.detach().numpy()``; another object exporting ``__dlpack__`` on the
    CPU, ``numpy.from_dlpack(x)``.

    Raises
    ------
    TypeError
        For a torch tensor on a GPU (use CuPy arrays there: ``cupy.from_dlpack``), or of a
        dtype that NumPy lacks (bfloat16, ...), or one NumPy cannot view (conjugate bit set).
    """
    if type(x) is np.ndarray:
        return x
    if is_tensor(x):
        if x.device.type != "cpu":
            raise TypeError(f"{name} is a torch tensor on {x.device}: tensorplay_mpi takes torch "
                            "tensors on the CPU only; on GPUs pass CuPy arrays "
                            "(cupy.from_dlpack(tensor.detach()) shares the memory)")
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


def as_arrays(xs: Any, name: str) -> list[Any]:
    """:func:`as_array` of each of `xs` (``params[i]`` and so on, for `name` ``"params"``)."""
    return [as_array(x, f"{name}[{i}]") for i, x in enumerate(xs)]


def like(template: Any, array: np.ndarray) -> Any:
    """`array` as the kind of `template`: a torch tensor sharing its memory when `template`
    is one, else `array` itself."""
    if type(template) is not np.ndarray and is_tensor(template):
        return sys.modules["torch"].from_numpy(array)
    return array
