"""Gradient clipping by the total L2 norm."""

from __future__ import annotations

import math
from typing import Any, Sequence

_CHUNK = 1 << 16  # elements converted to float64 at a time


def clip_grad_norm(grads: Sequence[Any], max_norm: float) -> float:
    """Scale `grads` in place so that their total L2 norm is at most `max_norm`.

    As ``torch.nn.utils.clip_grad_norm_``: the factor is ``max_norm / (norm + 1e-6)``, applied
    only when it is below 1; a non-finite norm (an inf or nan gradient) scales nothing.  The
    sum of squares is accumulated in float64, so float32 gradients of 1e20 clip correctly.
    Local: no communication.  After ``dp.step()`` the gradients are identical on every rank,
    so the norm and the clipping are too; with ZeRO, clip ``dp.grads`` after ``dp.step()``
    and before ``zero.step()``.

    Parameters
    ----------
    grads : sequence of arrays
        NumPy or CuPy gradients (``dp.grads``, for example), 0-d included.
    max_norm : float
        The largest total norm allowed, >= 0.

    Returns
    -------
    float
        The total norm before clipping.

    Raises
    ------
    ValueError
        If `max_norm` is negative or not a number.
    """
    if not max_norm >= 0:
        raise ValueError(f"max_norm must be >= 0, got {max_norm!r}")
    norm = math.sqrt(sum(_sum_of_squares(g.reshape(-1)) for g in grads))
    factor = max_norm / (norm + 1e-6)
    if factor < 1.0 and math.isfinite(norm):
        for g in grads:
            g *= factor
    return norm


def _sum_of_squares(flat: Any) -> float:
    """Accumulated in float64, a chunk at a time: float32 squares of 1e20 overflow."""
    if flat.dtype == "float64":
        return float(flat @ flat)
    total = 0.0
    for start in range(0, flat.size, _CHUNK):
        chunk = flat[start:start + _CHUNK].astype("float64")
        total += float(chunk @ chunk)
    return total
