"""The update rules of SGD and Adam(W), shared by the local optimizers and ZeRO's shards.

NumPy arrays of float32 and float64 take the fused kernels of :mod:`tensorplay_mpi.optim._fused`
(one pass over memory) when numba is installed (the ``fused`` extra) and
``TENSORPLAY_MPI_FUSED`` is not ``0``: see :func:`fused`.  Otherwise they are updated block by
block with in-place ufuncs (``out=``) into a preallocated scratch: each block of the parameter,
gradient and state is read from memory once and written once while it sits in cache, and
nothing is allocated on the hot path.  Both give bitwise identical results.  CuPy arrays get one
fused elementwise kernel per rule (compiled on first use; CuPy is looked up in
``sys.modules``, never imported here).

Every function takes flat (1-d) views: a 0-d parameter is a view of shape ``(1,)``.
"""

from __future__ import annotations

import math
import sys
from functools import lru_cache
from typing import Any

import numpy as np

from .._resets import register
from ..settings import settings

BLOCK_BYTES = 1 << 20
"""Bytes per array per block: the working set of a block (5 to 6 arrays) stays in the last-level
cache, and blocks are large enough that the fixed cost of a ufunc call is negligible (on the
benchmark machine 1 MiB beat 64 KiB to 512 KiB, ``benchmarks/bench_optim.py``)."""


_ALIGN = 64  # bytes: a cache line; misaligned operands make NumPy's SIMD loops several x slower


def aligned_zeros(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Zeros whose data starts on a cache line (NumPy's allocator only promises 16 bytes)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.zeros(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


class Scratch:
    """Two reusable blocks per dtype, made (or grown, up to a block) in the first step."""

    def __init__(self) -> None:
        self._blocks: dict[np.dtype, np.ndarray] = {}

    def get(self, dtype: np.dtype, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Two blocks of `n` elements, `n` at most a block."""
        blocks = self._blocks.get(dtype)
        if blocks is None or blocks.shape[1] < n:
            blocks = self._blocks[dtype] = aligned_zeros((2, n), dtype)
        return blocks[0, :n], blocks[1, :n]


def fused() -> Any:
    """The fused kernels' module, or None: ``TENSORPLAY_MPI_FUSED=0``, or numba missing.

    Raises
    ------
    RuntimeError
        If ``TENSORPLAY_MPI_FUSED=1`` and numba cannot be imported.
    """
    setting = settings().fused
    if setting == "0":
        return None
    kernels = _import_fused()
    if kernels is None and setting == "1":
        raise RuntimeError("TENSORPLAY_MPI_FUSED=1 but numba cannot be imported: install the "
                           "fused extra (pip install 'tensorplay-mpi[fused]')")
    return kernels


@lru_cache(maxsize=1)
def _import_fused() -> Any:
    try:
        from . import _fused as kernels
    except ImportError:
        return None
    return kernels


register(_import_fused.cache_clear)


def warm_up(params: Any) -> None:
    """Compile (or load from cache) the fused kernels for the dtypes of `params` now."""
    kernels = fused()
    if kernels is not None:
        kernels.warm_up({p.dtype for p in params if type(p) is np.ndarray})


def _cupy_of(p: Any) -> Any:
    """The CuPy module if `p` is a CuPy array, else None."""
    if type(p) is np.ndarray:
        return None
    cupy = sys.modules.get("cupy")
    return cupy if cupy is not None and isinstance(p, cupy.ndarray) else None


def _blocks(a: np.ndarray):
    step = max(1, BLOCK_BYTES // a.itemsize)
    for start in range(0, a.size, step):
        yield slice(start, min(start + step, a.size))


def sgd(p: Any, g: Any, buf: Any | None, scratch: Scratch, lr: float, momentum: float,
        weight_decay: float, nesterov: bool, maximize: bool = False) -> None:
    """One SGD step, in place: ``d = g + weight_decay * p`` (``-g`` in place of `g` if
    `maximize`, as torch.optim); with `buf`, ``buf = momentum * buf + d`` and
    ``d = d + momentum * buf`` (Nesterov) or ``d = buf``; then ``p -= lr * d``.

    Parameters
    ----------
    p, g, buf : flat arrays of one dtype and size
        Parameter and momentum buffer (updated), gradient (read); `buf` None: no momentum.
    scratch : Scratch
        Reused blocks (NumPy only).
    """
    cupy = _cupy_of(p)
    if cupy is not None:
        if buf is None:
            _kernel(cupy, "sgd")(g, lr, weight_decay, float(maximize), p)
        else:
            _kernel(cupy, "sgd_momentum")(g, lr, momentum, weight_decay, float(nesterov),
                                          float(maximize), p, buf)
        return
    # Python floats are cast to the array's dtype, as in the fused kernels (NumPy's are not)
    lr, momentum, weight_decay = float(lr), float(momentum), float(weight_decay)
    kernels = fused()
    if kernels is not None and kernels.fits(p, g, *(() if buf is None else (buf,))):
        kernels.sgd(p, g, buf, lr, momentum, weight_decay, nesterov, maximize)
        return
    for s in _blocks(p):
        pb, gb = p[s], g[s]
        s1, s2 = scratch.get(p.dtype, pb.size)
        d = _signed(gb, pb, weight_decay, maximize, s1)
        if buf is not None:
            bb = buf[s]
            bb *= momentum
            bb += d
            if nesterov:
                np.multiply(bb, momentum, out=s2)
                d = np.add(s2, d, out=s2)
            else:
                d = bb
        np.multiply(d, lr, out=s2)
        pb -= s2


def adam(p: Any, g: Any, m: Any, v: Any, scratch: Scratch, lr: float, beta1: float,
         beta2: float, eps: float, weight_decay: float, decoupled: bool, step: int,
         maximize: bool = False) -> None:
    """One Adam step number `step` (from 1): PyTorch's rule, bias corrections folded in.

    ``g = -g`` if `maximize`; ``p *= 1 - lr * weight_decay`` (decoupled) or
    ``g += weight_decay * p`` (L2); then
    ``m = beta1 m + (1 - beta1) g``, ``v = beta2 v + (1 - beta2) g^2`` and
    ``p -= lr * sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + eps * sqrt(1 - beta2^t))``,
    which is ``p -= lr * m_hat / (sqrt(v_hat) + eps)``.

    Parameters
    ----------
    p, g, m, v : flat arrays of one dtype and size
        Parameter and moments (updated), gradient (read).
    scratch : Scratch
        Reused blocks (NumPy only).
    """
    beta1, beta2 = float(beta1), float(beta2)  # Python floats, as for sgd
    root = math.sqrt(1.0 - beta2 ** step)
    step_size = lr * root / (1.0 - beta1 ** step)
    eps_hat = eps * root
    decay = 1.0 - lr * weight_decay if decoupled else 1.0
    l2 = 0.0 if decoupled else weight_decay
    step_size, eps_hat, decay, l2 = float(step_size), float(eps_hat), float(decay), float(l2)
    cupy = _cupy_of(p)
    if cupy is not None:
        _kernel(cupy, "adam")(g, beta1, beta2, l2, decay, step_size, eps_hat, float(maximize),
                              p, m, v)
        return
    kernels = fused()
    if kernels is not None and kernels.fits(p, g, m, v):
        kernels.adam(p, g, m, v, beta1, beta2, l2, decay, step_size, eps_hat, maximize)
        return
    for s in _blocks(p):
        pb, gb, mb, vb = p[s], g[s], m[s], v[s]
        s1, s2 = scratch.get(p.dtype, pb.size)
        if decay != 1.0:
            pb *= decay
        gb = _signed(gb, pb, l2, maximize, s2)
        mb *= beta1
        np.multiply(gb, 1.0 - beta1, out=s1)
        mb += s1
        vb *= beta2
        np.multiply(gb, gb, out=s1)
        s1 *= 1.0 - beta2
        vb += s1
        np.sqrt(vb, out=s1)
        s1 += eps_hat
        np.divide(mb, s1, out=s1)
        s1 *= step_size
        pb -= s1


def _signed(g: np.ndarray, p: np.ndarray, weight_decay: float, maximize: bool,
            out: np.ndarray) -> np.ndarray:
    """``weight_decay * p + g``, `g` negated if `maximize`: in `out`, or `g` itself when
    that is all it is (no copy)."""
    if weight_decay:
        np.multiply(p, weight_decay, out=out)
        return (np.subtract if maximize else np.add)(out, g, out=out)
    return np.negative(g, out=out) if maximize else g


_KERNELS: dict[str, Any] = {}  # name -> compiled CuPy kernel: filled by _kernel on first use

_SOURCES = {
    # name: (inputs, outputs (read and written), body)
    "sgd": ("T g, T lr, T wd, T maximize", "T p",
            "p = p - lr * ((maximize != 0 ? -g : g) + wd * p);"),
    "sgd_momentum": (
        "T g, T lr, T momentum, T wd, T nesterov, T maximize", "T p, T buf",
        "T d = (maximize != 0 ? -g : g) + wd * p; buf = momentum * buf + d;"
        "p = p - lr * (nesterov != 0 ? d + momentum * buf : buf);"),
    "adam": (
        "T g, T beta1, T beta2, T l2, T decay, T step_size, T eps_hat, T maximize",
        "T p, T m, T v",
        "T d = (maximize != 0 ? -g : g) + l2 * p; p = p * decay;"
        "m = beta1 * m + (1 - beta1) * d; v = beta2 * v + (1 - beta2) * d * d;"
        "p = p - step_size * m / (sqrt(v) + eps_hat);"),
}


def _kernel(cupy: Any, name: str) -> Any:
    kernel = _KERNELS.get(name)
    if kernel is None:
        inputs, outputs, body = _SOURCES[name]
        kernel = _KERNELS[name] = cupy.ElementwiseKernel(inputs, outputs, body,
                                                         f"tensorplay_{name}")
    return kernel
