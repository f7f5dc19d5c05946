"""Half-precision gradients (bfloat16, float16) reduced through a float32 wire.

MPI has no bfloat16 type and no reduction for it (nor, before MPI 4.1, for float16), and a
half-precision sum rounds at every addition, in an order that depends on the MPI algorithm.
A half-precision bucket therefore keeps its gradients in the model's format (``p.grad`` is a
view of that memory, so autograd writes there) and reduces a float32 copy: each rank widens
its gradients (exact), MPI sums them with its native ``SUM`` over float32, the sum is divided
in float32, and the mean is rounded to the model's format once, round to nearest even.  The
result is within half a unit in the last place of the format (plus float32's own rounding of
the sum, 2**-24 relative per addition) of the exact mean, whatever the reduction tree; the
price is a wire twice the size of the gradients.

bfloat16 has no NumPy dtype: its memory is carried as int16 (its bits, for MPI and for files)
and converted by torch, which bfloat16 tensors come from.  float16 is NumPy's own.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

BFLOAT16_BITS = np.dtype(np.int16)
"""The dtype that carries a bfloat16 tensor's bits in DataParallel (no other param has it)."""

NARROW = (np.dtype(np.float16), BFLOAT16_BITS)
"""The dtypes whose buckets reduce through a float32 wire."""

WIRE = np.dtype(np.float32)


def format_name(dtype: np.dtype) -> str:
    """The floating-point format a param array of `dtype` holds."""
    return "bfloat16" if dtype == BFLOAT16_BITS else str(dtype)


class Widening:
    """Copies between `narrow`, gradients in half precision, and `wide`, float32 of as many
    elements, made once: converting allocates nothing.

    Parameters
    ----------
    narrow : numpy.ndarray
        float16, or int16 holding bfloat16 bits.
    wide : numpy.ndarray
        float32, the same number of elements.
    """

    __slots__ = ("_narrow", "_wide")

    def __init__(self, narrow: np.ndarray, wide: np.ndarray) -> None:
        if narrow.dtype == BFLOAT16_BITS:
            torch = sys.modules["torch"]  # bfloat16 params are torch tensors: torch is loaded
            self._narrow: Any = torch.from_numpy(narrow).view(torch.bfloat16)
            self._wide: Any = torch.from_numpy(wide)
        else:
            self._narrow, self._wide = narrow, wide

    def widen(self) -> None:
        """``wide = narrow``, exactly."""
        if isinstance(self._wide, np.ndarray):
            np.copyto(self._wide, self._narrow)
        else:
            self._wide.copy_(self._narrow)

    def round(self) -> None:
        """``narrow = wide``, rounded to nearest even (overflow to infinity, NaN kept)."""
        if isinstance(self._wide, np.ndarray):
            with np.errstate(over="ignore"):  # an infinity, as torch's float16 gives: no warning
                np.copyto(self._narrow, self._wide, casting="same_kind")
        else:
            self._narrow.copy_(self._wide)
