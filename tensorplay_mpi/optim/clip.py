"""Gradient clipping by the total L2 norm."""

from __future__ import annotations

import math
from typing import Any, Sequence

__all__ = ["clip_grad_norm"]


def clip_grad_norm(grads: Sequence[Any], max_norm: float) -> float:
    """Scale `grads` in place so that their total L2 norm is at most `max_norm`.

    As ``torch.nn.utils.clip_grad_norm_``: the factor is ``max_norm / (norm + 1e-6)``, applied
    only when it is below 1; a non-finite norm scales nothing.  Local: no communication.  After
    ``dp.step()`` the gradients are identical on every rank, so the norm and the clipping are
    too; with ZeRO, clip ``dp.grads`` after ``dp.step()`` and before ``zero.step()``.

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
    total = 0.0
    for g in grads:
        flat = g.reshape(-1)
        total += float(flat @ flat)
    norm = math.sqrt(total)
    factor = max_norm / (norm + 1e-6)
    if factor < 1.0:
        for g in grads:
            g *= factor
    return norm
