"""Fused SGD and Adam(W) steps for NumPy arrays: one pass over memory, compiled with numba.

Each kernel reads every element of the parameter, gradient and state once and writes it once
(7 array passes for Adam, 5 for SGD with momentum), where NumPy's ufuncs need a pass per
operation.  The arithmetic is that of the NumPy rules in :mod:`tensorplay_mpi.optim._rules`,
operation for operation in the array's dtype (no fast-math, no fused multiply-add), so both
paths give bitwise identical results.  Only float32 and float64 arrays in native byte order,
C-contiguous, come here; the rules keep NumPy for the rest.

The kernels are compiled on first use for each dtype (about a second per kernel and dtype) and
cached on disk by numba (``cache=True``: next to this file, or in numba's user cache directory
when that is not writable), so later processes load them in milliseconds.  The optimizers
compile theirs at construction (:func:`warm_up`), so that cost never lands in a training step.
They run on the calling thread only and never use numba's thread pool, so they stay within
the thread limit of :mod:`tensorplay_mpi._threads` (one thread per rank already meets the
memory-traffic floor).
Importing this module imports numba: :func:`tensorplay_mpi.optim._rules.fused` decides whether.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
"""The dtypes the kernels are compiled for."""
_DTYPES = frozenset(DTYPES)

_jit = numba.njit(cache=True, nogil=True, error_model="numpy")


# Scalars arrive as Python floats (float64: the cheapest to pass) and are rounded to the
# array's dtype here, as NumPy rounds a Python float operand of a float32 ufunc.

@_jit
def _sgd(p, g, buf, lr, momentum, weight_decay, use_buf, nesterov,
         maximize):  # pragma: no cover
    t = p.dtype.type
    lr, momentum, weight_decay = t(lr), t(momentum), t(weight_decay)
    for i in range(p.size):
        d = -g[i] if maximize else g[i]
        if weight_decay != 0:
            d = p[i] * weight_decay + d
        if use_buf:
            b = buf[i] * momentum + d
            buf[i] = b
            d = b * momentum + d if nesterov else b
        p[i] = p[i] - d * lr


@_jit
def _adam(p, g, m, v, beta1, c1, beta2, c2, l2, decay, step_size, eps_hat,
          maximize):  # pragma: no cover
    t = p.dtype.type
    beta1, c1, beta2, c2, l2 = t(beta1), t(c1), t(beta2), t(c2), t(l2)
    decay, step_size, eps_hat = t(decay), t(step_size), t(eps_hat)
    for i in range(p.size):
        pi = p[i]
        if decay != 1:
            pi = pi * decay
        d = -g[i] if maximize else g[i]
        if l2 != 0:
            d = pi * l2 + d
        mi = m[i] * beta1 + d * c1
        vi = v[i] * beta2 + d * d * c2
        m[i] = mi
        v[i] = vi
        p[i] = pi - mi / (np.sqrt(vi) + eps_hat) * step_size


def sgd(p: np.ndarray, g: np.ndarray, buf: np.ndarray | None, lr: float, momentum: float,
        weight_decay: float, nesterov: bool, maximize: bool) -> None:
    """:func:`tensorplay_mpi.optim._rules.sgd` in one pass (arrays as :func:`fits` accepts,
    scalars Python floats)."""
    _sgd(p, g, p[:0] if buf is None else buf, lr, momentum, weight_decay, buf is not None,
         bool(nesterov), bool(maximize))


def adam(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, beta1: float,
         beta2: float, l2: float, decay: float, step_size: float, eps_hat: float,
         maximize: bool) -> None:
    """:func:`tensorplay_mpi.optim._rules.adam` in one pass, bias corrections folded in."""
    _adam(p, g, m, v, beta1, 1.0 - beta1, beta2, 1.0 - beta2, l2, decay, step_size, eps_hat,
          bool(maximize))


def fits(*arrays: Any) -> bool:
    """Whether the kernels take `arrays`: NumPy, one dtype of :data:`DTYPES`, C-contiguous and
    writable (the types :func:`warm_up` compiles for: nothing compiles in a step)."""
    dtype = arrays[0].dtype
    if dtype not in _DTYPES:
        return False
    for a in arrays:
        if type(a) is not np.ndarray or a.dtype != dtype:
            return False
        flags = a.flags
        if not (flags.c_contiguous and flags.writeable):
            return False
    return True


def warm_up(dtypes: Any) -> None:
    """Compile (or load from numba's cache) the kernels for each of `dtypes` they take."""
    for dtype in set(dtypes) & set(DTYPES):
        empty = np.zeros(0, dtype)
        sgd(empty, empty, empty, 0.0, 0.0, 0.0, False, False)
        adam(empty, empty, empty, empty, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, False)
