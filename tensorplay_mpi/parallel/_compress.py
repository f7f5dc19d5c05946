"""Compressed gradient reduction: float32 buckets summed in bfloat16 or float16 on the wire.

``DataParallel(compress="bf16")`` (or ``"fp16"``) does what DDP's ``bf16_compress_hook`` and
``fp16_compress_hook`` do: each rank divides its float32 bucket by the step's divisor (in
float32), rounds it to the 16-bit format (to nearest even), the allreduce sums the 16-bit
values, and the sum is widened back into the bucket.  Dividing first keeps a float16 sum in
range, as DDP's hook does.  The wire carries half the bytes; the price is precision: one
rounding of each rank's term and one per addition of the reduction, whose order MPI chooses.

MPI has no 16-bit floating sum, so the wire is ``uint16`` (the values' bits) summed by a
user-defined, commutative operation that widens both operands to float32, adds and rounds to
the format: addition is commutative bitwise, so every rank of an allreduce holds the same
bits, joined ranks' zeros change nothing, and every rank widens them alike.  The operation
runs inside MPI's progress (in the library's waits), in Python, on NumPy, and allocates two
float32 temporaries of the pieces MPI hands it (a joined rank's shadow too): the buckets and
their wires are made once.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from mpi4py import MPI

COMPRESSIONS = ("bf16", "fp16")
"""The values of ``DataParallel(compress=)`` besides None."""


def to_bfloat16(src: np.ndarray, dst: np.ndarray, scratch: np.ndarray) -> None:
    """`dst` (uint16) = the bfloat16 bits of float32 `src`, rounded to nearest even; `scratch`
    is uint32 of as many elements.  Overflow gives infinity, NaN stays NaN."""
    bits = src.view(np.uint32)
    np.right_shift(bits, 16, out=scratch)
    np.bitwise_and(scratch, 1, out=scratch)  # ties go to the even neighbour
    scratch += 0x7FFF
    scratch += bits  # a NaN's carry could reach the exponent: fixed below
    scratch >>= 16
    np.copyto(dst, scratch, casting="unsafe")
    with np.errstate(over="ignore", invalid="ignore"):
        total = src.sum(dtype=np.float32)
    if np.isnan(total):  # inf - inf is NaN too: then look closely
        nan = np.isnan(src)
        dst[nan] = (bits[nan] >> 16).astype(np.uint16) | 0x0040  # quiet NaN, same sign


def from_bfloat16(src: np.ndarray, dst: np.ndarray) -> None:
    """`dst` (float32) = the bfloat16 values whose bits `src` (uint16) holds, exactly."""
    np.left_shift(src, 16, out=dst.view(np.uint32), dtype=np.uint32)


def to_float16(src: np.ndarray, dst: np.ndarray, scratch: Any = None) -> None:
    """`dst` (uint16) = the float16 bits of float32 `src`, rounded to nearest even."""
    with np.errstate(over="ignore"):  # an infinity, as torch's float16 gives: no warning
        np.copyto(dst.view(np.float16), src, casting="same_kind")


def from_float16(src: np.ndarray, dst: np.ndarray) -> None:
    """`dst` (float32) = the float16 values whose bits `src` (uint16) holds, exactly."""
    np.copyto(dst, src.view(np.float16))


def _sum_bfloat16(inbuf: Any, inoutbuf: Any, datatype: MPI.Datatype) -> None:
    a = np.frombuffer(inbuf, np.uint16)
    b = np.frombuffer(inoutbuf, np.uint16)
    wide = np.empty(a.size, np.float32)
    from_bfloat16(a, wide)
    other = np.empty(a.size, np.float32)
    from_bfloat16(b, other)
    with np.errstate(over="ignore", invalid="ignore"):
        wide += other
    to_bfloat16(wide, b, other.view(np.uint32))


def _sum_float16(inbuf: Any, inoutbuf: Any, datatype: MPI.Datatype) -> None:
    b = np.frombuffer(inoutbuf, np.uint16).view(np.float16)
    with np.errstate(over="ignore", invalid="ignore"):
        np.add(np.frombuffer(inbuf, np.uint16).view(np.float16), b, out=b)


_FORMATS: dict[str, tuple[Callable, Callable, Callable]] = {
    "bf16": (to_bfloat16, from_bfloat16, _sum_bfloat16),
    "fp16": (to_float16, from_float16, _sum_float16),
}
_OPS: dict[str, MPI.Op] = {}  # made once per process, on first use (MPI is initialised then)


class Compression:
    """One float32 bucket's 16-bit wire, made once: compressing allocates nothing.

    Parameters
    ----------
    name : str
        ``"bf16"`` or ``"fp16"``.
    flat : numpy.ndarray
        The bucket's float32 buffer.
    """

    __slots__ = ("wire", "op", "_flat", "_scratch", "_to", "_from")

    def __init__(self, name: str, flat: np.ndarray) -> None:
        self._to, self._from, summing = _FORMATS[name]
        if name not in _OPS:
            _OPS[name] = MPI.Op.Create(summing, commute=True)
        self.op = _OPS[name]
        self._flat = flat
        self.wire = np.zeros(flat.size, np.uint16)
        self._scratch = np.empty(flat.size, np.uint32) if name == "bf16" else None

    def compress(self) -> np.ndarray:
        """The bucket rounded into the wire; the wire."""
        self._to(self._flat, self.wire, self._scratch)
        return self.wire

    def decompress(self) -> None:
        """The reduced wire widened back into the bucket."""
        self._from(self.wire, self._flat)
