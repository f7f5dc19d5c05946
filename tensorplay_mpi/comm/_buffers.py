"""Arrays and devices: where a buffer lives, stream safety, CUDA-awareness and host staging.

NumPy arrays go to MPI as they are.  A device array (recognised by
``__cuda_array_interface__`` or a CUDA DLPack device: CuPy's, in practice) is first synchronised
with the stream that produced it (mpi4py never does it; a missing sync is a silent data race),
then:

- when MPI is CUDA-aware, its device pointer goes straight to MPI (any such array works);
- otherwise it is staged through CuPy's ``get(out=)`` and ``set()``: copied into a host buffer
  that belongs to that one operation (pinned, from CuPy's pinned-memory pool), MPI runs on host
  memory, and buffers MPI wrote are copied back to the device when the operation completes (at
  wait), so nonblocking semantics are kept.  A device array without those two methods raises
  ``TypeError`` on this path.

CuPy is never imported here: it is looked up in ``sys.modules``.
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import sys
from functools import lru_cache
from typing import Any

import numpy as np
from mpi4py import MPI

from .._resets import register
from ..settings import settings
from . import _torch_cuda as torch_cuda

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")
_DLPACK_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged


def check_device(device: object, name: str = "device") -> str:
    """Return `device` if it is a device string (``"cpu"``, ``"cuda"``, ``"cuda:N"``), else raise.

    Raises
    ------
    TypeError
        If `device` is not a string.
    ValueError
        If the string names no device.
    """
    if not isinstance(device, str):
        raise TypeError(f"{name} must be a str such as 'cpu' or 'cuda:0', "
                        f"got {type(device).__name__}")
    if not _DEVICE.fullmatch(device):
        raise ValueError(f"{name} must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return device


def device_of(array: Any) -> str:
    """``"cpu"`` or ``"cuda:N"`` (``"cuda"`` when the index is unknown), without importing CuPy."""
    dlpack = getattr(array, "__dlpack_device__", None)
    if dlpack is not None:
        kind, index = dlpack()
        return f"cuda:{index}" if kind in _DLPACK_CUDA else "cpu"
    return "cuda" if hasattr(array, "__cuda_array_interface__") else "cpu"


def is_device_array(array: Any) -> bool:
    """True for arrays in GPU memory (CuPy, ``__cuda_array_interface__``, CUDA DLPack)."""
    return type(array) is not np.ndarray and device_of(array) != "cpu"


def zeros_like(array: Any, size: int | None = None, dtype: Any = None) -> Any:
    """Zeros on `array`'s device and of its kind (flat of `size` when given)."""
    if type(array) is np.ndarray and size is None and dtype is None:
        return np.zeros(array.shape, array.dtype)
    cupy = sys.modules.get("cupy")
    shape = array.shape if size is None else (size,)
    if cupy is not None and isinstance(array, cupy.ndarray):
        with array.device:  # CuPy allocates on its current device, not the array's
            return cupy.zeros_like(array, shape=shape, dtype=dtype or array.dtype)
    return np.zeros_like(array, shape=shape, dtype=dtype or array.dtype)


def copy_into(dst: Any, src: Any) -> None:
    """Copy the elements of `src` into `dst` (C-contiguous, as many elements, the same dtype),
    on `dst`'s device.

    Raises
    ------
    ValueError
        If the numbers of elements differ.
    TypeError
        If the dtypes differ.
    """
    flat_dst = np.asarray(dst) if isinstance(dst, memoryview) else dst
    flat_src = np.asarray(src) if isinstance(src, memoryview) else src
    if flat_dst.size != flat_src.size:
        raise ValueError(f"cannot copy {flat_src.size} elements into {flat_dst.size}")
    if flat_dst.dtype != flat_src.dtype:
        raise TypeError(f"cannot copy {flat_src.dtype} elements into a {flat_dst.dtype} array")
    if type(flat_dst) is np.ndarray:
        np.copyto(flat_dst.reshape(-1), np.asarray(flat_src).reshape(-1))
    else:
        flat_dst.reshape(-1)[...] = flat_src.reshape(-1)


def misordered(array: Any) -> str | None:
    """``"Fortran-ordered"`` or ``"strided"`` for an array that is not C-contiguous (MPI
    reads and writes memory in order, so it would scramble or refuse it), else ``None``."""
    flags = getattr(array, "flags", None)
    if flags is None or flags.c_contiguous:
        return None
    return "Fortran-ordered" if flags.f_contiguous else "strided"


def _extent(array: Any) -> tuple[int, int]:
    """The addresses ``[low, high)`` that `array`'s elements span (empty for no element)."""
    face = getattr(array, "__array_interface__", None) or array.__cuda_array_interface__
    low, shape, strides = face["data"][0], face["shape"], face.get("strides")
    itemsize = np.dtype(face["typestr"]).itemsize
    if 0 in shape:
        return low, low
    if strides is None:  # C-contiguous
        return low, low + math.prod(shape) * itemsize
    spans = [(n - 1) * stride for n, stride in zip(shape, strides)]
    return (low + sum(s for s in spans if s < 0),
            low + sum(s for s in spans if s > 0) + itemsize)


def check_disjoint(**named: list[Any]) -> None:
    """Raise ``ValueError`` if two of the arrays share memory (the same array twice, or views
    of one buffer; interleaved views such as ``x[::2]`` and ``x[1::2]`` count too): MPI may
    not write one buffer from two operations, and an update would apply once per listing.

    `named` maps a name to a list of arrays (``params=..., grads=...``), for the message.
    """
    names = [f"{name}[{i}]" for name, arrays in named.items() for i in range(len(arrays))]
    extents = sorted((_extent(a), k) for k, a in
                     enumerate(a for arrays in named.values() for a in arrays))
    reach, widest = -1, -1  # the highest end so far, and whose
    for (low, high), k in extents:
        if low == high:
            continue
        if low < reach:
            first, second = sorted((widest, k))
            raise ValueError(f"{names[first]} and {names[second]} share memory (the same "
                             "array twice, or views of one buffer): pass each array once (a "
                             "tied parameter once, with the sum of its gradients)")
        if high > reach:
            reach, widest = high, k


# -- stream safety -----------------------------------------------------------------------------

def synchronize(array: Any) -> None:
    """Wait until the device work that produces `array` is done: CuPy's current stream (or
    the stream its ``__cuda_array_interface__`` names), and torch's current stream on its
    device once torch CUDA tensors are in use (:mod:`.torch_cuda`)."""
    torch_cuda.synchronize(_device_index(array))
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(array, cupy.ndarray):
        cupy.cuda.get_current_stream().synchronize()
        return
    stream = getattr(array, "__cuda_array_interface__", {}).get("stream")
    if stream:
        synchronize_stream(stream)


def _device_index(array: Any) -> int:
    dlpack = getattr(array, "__dlpack_device__", None)
    return int(dlpack()[1]) if dlpack is not None else 0


def synchronize_stream(stream: int) -> None:
    """Synchronise a CUDA stream given by its ``__cuda_array_interface__`` handle."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        raise RuntimeError("a device array names a CUDA stream, but CuPy is not imported to "
                           "synchronise it; import cupy first")
    cupy.cuda.ExternalStream(stream).synchronize()


# -- CUDA-awareness ----------------------------------------------------------------------------

@lru_cache(maxsize=1)
def cuda_aware() -> tuple[bool, str]:
    """Whether device pointers may go to MPI, and why; decided once per process.

    ``TENSORPLAY_MPI_CUDA_AWARE``: ``1`` forces yes, ``0`` forces no, ``auto`` (default) says yes
    only when the MPI library itself reports CUDA support (MPI 4.1 ``mpi_memory_alloc_kinds``
    containing ``cuda``, or MPICH's ``MPIX_GPU_query_support`` / Open MPI's
    ``MPIX_Query_cuda_support`` returning 1).  Never from environment guesses: a wrong yes
    segfaults.  Cached: :func:`tensorplay_mpi.testing.reset_settings` makes the next call
    decide again.

    Raises
    ------
    ValueError
        If the variable is set to anything else.
    """
    setting = settings().cuda_aware
    if setting == "1":
        return True, "forced by TENSORPLAY_MPI_CUDA_AWARE=1"
    if setting == "0":
        return False, "forced by TENSORPLAY_MPI_CUDA_AWARE=0 (device buffers are staged)"
    kinds = _memory_alloc_kinds()
    if "cuda" in kinds:
        return True, f"the MPI library reports mpi_memory_alloc_kinds={kinds}"
    for symbol, answer in _query_libmpi().items():
        if answer == 1:
            return True, f"the MPI library's {symbol} returned 1"
    return False, ("the MPI library reports no CUDA support (mpi_memory_alloc_kinds="
                   f"{kinds or 'unset'}; {_query_libmpi() or 'no MPIX query'}): "
                   "device buffers are staged through host memory")


register(cuda_aware.cache_clear, "settings")


def _memory_alloc_kinds() -> str:
    try:
        info = MPI.COMM_WORLD.Get_info()
        try:
            return info.Get("mpi_memory_alloc_kinds") or ""
        finally:
            info.Free()
    except MPI.Exception:
        return ""


def _query_libmpi() -> dict[str, int]:
    """Answers of the MPIX CUDA-support queries that the loaded libmpi has."""
    answers: dict[str, int] = {}
    for path in loaded_libmpi():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "MPIX_GPU_query_support"):
            supported = ctypes.c_int(0)
            if lib.MPIX_GPU_query_support(0, ctypes.byref(supported)) == 0:  # 0: CUDA
                answers["MPIX_GPU_query_support(CUDA)"] = supported.value
        if hasattr(lib, "MPIX_Query_cuda_support"):
            answers["MPIX_Query_cuda_support"] = int(lib.MPIX_Query_cuda_support())
    return answers


def loaded_libmpi() -> list[str]:
    """The paths of the MPI libraries loaded in this process (from ``/proc/self/maps``)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi" in line and "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith("libmpi"))


# -- staging -------------------------------------------------------------------------------------

def _host_buffer(array: Any) -> np.ndarray:
    """A host buffer for one operation on `array` (pinned when CuPy is there)."""
    if not (callable(getattr(array, "get", None)) and callable(getattr(array, "set", None))):
        raise TypeError(f"staging a device array through host memory needs CuPy's get()/set(); "
                        f"a {type(array).__name__} has not both: use cupy.asarray, or a "
                        "CUDA-aware MPI (TENSORPLAY_MPI_CUDA_AWARE=1)")
    if "cupy" in sys.modules:  # pinned memory: faster copies; CuPy pools it
        import cupyx

        return cupyx.empty_pinned(array.shape, dtype=array.dtype)
    return np.empty(array.shape, dtype=array.dtype)


class Staging:
    """How one MPI operation sees its buffers: device pointers, or host copies.

    The operation's Work keeps its :attr:`hosts` until the operation completes.
    ``read(buf)`` for a buffer MPI reads, ``write(buf)`` for one it writes, ``update(buf)``
    for one it reads and writes (``IN_PLACE``); each returns what to give MPI.  ``finish()``
    copies written buffers back to the device; call it when the operation has completed.
    """

    __slots__ = ("_copy_back", "_synced", "hosts")

    def __init__(self) -> None:
        self._copy_back: list[tuple[Any, np.ndarray]] = []
        self._synced = False
        self.hosts: tuple[np.ndarray, ...] = ()  # this operation's host buffers, kept until done

    def read(self, buf: Any) -> Any:
        return self._stage(buf, copy_in=True, copy_back=False)

    def write(self, buf: Any) -> Any:
        return self._stage(buf, copy_in=False, copy_back=True)

    def update(self, buf: Any) -> Any:
        return self._stage(buf, copy_in=True, copy_back=True)

    def _stage(self, buf: Any, copy_in: bool, copy_back: bool) -> Any:
        if not is_device_array(buf):
            return buf
        if not self._synced:  # one stream synchronisation per operation
            synchronize(buf)
            self._synced = True
        if cuda_aware()[0]:
            return buf
        host = _host_buffer(buf)
        self.hosts += (host,)
        if copy_in:
            buf.get(out=host)
        if copy_back:
            self._copy_back.append((buf, host))
        return host

    @property
    def copies_back(self) -> bool:
        """Whether :meth:`finish` has anything to copy back."""
        return bool(self._copy_back)

    def finish(self) -> None:
        for device, host in self._copy_back:
            device.set(host)
        self._copy_back.clear()
        torch_cuda.hand_back()
