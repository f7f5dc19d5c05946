"""Gradient buckets: flat per-dtype buffers that the gradients of several parameters share."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..comm._buffers import zeros_like
from ._compress import Compression
from ._narrow import NARROW, WIRE, Widening


class Bucket:
    """One flat gradient buffer and the parameters whose gradients live in it.

    ``flat`` holds the gradients, then one "used" flag per member (1 where this rank produced
    a gradient, 0 where not), then two sample slots (this rank's sample count and 1 when the
    step averages per sample, else zeros): the bucket's allreduce sums them with the
    gradients, so every rank learns how many ranks used each parameter, and how many samples
    the active ranks' gradients came from, without a message of its own.

    A half-precision bucket (float16, bfloat16 bits) keeps its gradients in ``memory``, in
    the parameters' format, and ``flat`` in float32 (:mod:`.narrow`): :meth:`pack` widens
    them into it before the allreduce, :meth:`unpack` rounds the mean back after it.
    Elsewhere ``memory`` is ``grads``, and both are no-ops.  A compressed bucket
    (:mod:`.compress`, float32) has a ``compression``: its 16-bit wire.
    """

    __slots__ = ("flat", "grads", "memory", "members", "index", "flags", "samples",
                 "all_used", "compression", "_widening")

    def __init__(self, like: Any, members: list[int], sizes: list[int],
                 compress: str | None = None) -> None:
        n, m = sum(sizes), len(members)
        narrow = like.dtype in NARROW
        # on the device and kind of `like`
        self.flat = zeros_like(like, n + m + 2, WIRE if narrow else None)
        self.grads = self.flat[:n]  # the gradients as reduced
        self.memory = zeros_like(like, n) if narrow else self.grads  # where p.grad lives
        self._widening = Widening(self.memory, self.grads) if narrow else None
        self.compression = None if compress is None else Compression(compress, self.flat)
        self.members = members  # parameter indices, in fill (reverse parameter) order
        self.index = np.asarray(members, dtype=np.intp)
        self.flags = self.flat[n:n + m]  # the "used" flags, summed with the gradients
        self.samples = self.flat[n + m:]  # [samples, 1] per rank averaging per sample
        self.all_used = True  # every member was used by some rank in the last step

    def pack(self) -> None:
        """Before the allreduce: the gradients into ``flat`` (half precision: widened)."""
        if self._widening is not None:
            self._widening.widen()

    def unpack(self) -> None:
        """After the allreduce and :meth:`divide`: the mean into ``memory`` (half precision:
        rounded once)."""
        if self._widening is not None:
            self._widening.round()

    def zero(self) -> None:
        """Every gradient and slot zero."""
        self.flat.fill(0)
        if self._widening is not None:
            self.memory.fill(0)

    def divide(self, divisor: float) -> None:
        """``flat /= divisor``, bitwise: by a power of two through its reciprocal (exact, and
        a multiply runs two to three times faster than a divide in NumPy), by 1 not at all."""
        if divisor == 1:
            return
        if math.frexp(divisor)[0] == 0.5:  # a power of two: x * (1 / d) == x / d exactly
            self.flat *= 1.0 / divisor
        else:
            self.flat /= divisor

    def read_flags(self) -> np.ndarray:
        """The flags as a NumPy array (copied to the host from a device bucket)."""
        flags = self.flags
        return flags if type(flags) is np.ndarray else flags.get()

    def read_samples(self) -> tuple[float, float]:
        """The summed sample slots: (samples, ranks that averaged per sample)."""
        slots = self.samples if type(self.samples) is np.ndarray else self.samples.get()
        return float(slots[0]), float(slots[1])

    def write_flags(self, has: np.ndarray) -> None:
        """Set the flags from booleans on the host."""
        if type(self.flags) is np.ndarray:
            self.flags[...] = has
        else:
            self.flags.set(has.astype(self.flags.dtype))


def make_buckets(params: list[np.ndarray], cap_bytes: float, frozen: Sequence[bool] = (),
                 compress: str | None = None
                 ) -> tuple[list[Bucket], list[int], list[np.ndarray]]:
    """Pack gradients of `params` into buckets of at most `cap_bytes` (one set per dtype;
    half-precision ones reduce in float32, :mod:`.narrow`).

    Buckets fill in reverse parameter order, the order a backward pass produces gradients;
    a parameter larger than the cap gets a bucket of its own.  A parameter flagged in
    `frozen` gets no bucket (its bucket index is -1) and a zero gradient that holds
    no memory (a zero-stride view of one element).  `compress` (float32 params): every
    bucket's wire in that 16-bit format.

    Returns
    -------
    buckets : list of Bucket
        In the order they fill, which is the order they are reduced on every rank.
    bucket_of : list of int
        The bucket index of each parameter.
    views : list of numpy.ndarray
        Each parameter's gradient: a zero-copy view into its bucket, shaped like the parameter.
    """
    plans: list[tuple[np.dtype, list[int]]] = []  # (dtype, members), in fill order
    filling: dict[np.dtype, tuple[int, int]] = {}  # dtype -> (its filling plan, bytes used)
    frozen = list(frozen) + [False] * (len(params) - len(frozen))
    for index in reversed(range(len(params))):
        if frozen[index]:
            continue
        param = params[index]
        current, used = filling.get(param.dtype, (None, 0))
        if current is None or used + param.nbytes > cap_bytes:
            current, used = len(plans), 0
            plans.append((param.dtype, []))
        plans[current][1].append(index)
        filling[param.dtype] = (current, used + param.nbytes)

    buckets, bucket_of = [], [-1] * len(params)
    views = {i: _no_gradient(params[i]) for i in range(len(params)) if frozen[i]}
    for k, (_, members) in enumerate(plans):
        bucket = Bucket(params[members[0]], members, [params[i].size for i in members], compress)
        offset = 0
        for i in members:
            size = params[i].size
            views[i] = bucket.memory[offset:offset + size].reshape(params[i].shape)
            bucket_of[i] = k
            offset += size
        buckets.append(bucket)
    return buckets, bucket_of, [views[i] for i in range(len(params))]


def _no_gradient(param: Any) -> Any:
    """A frozen parameter's gradient: zeros of its shape in one element of memory, on its
    device (torch refuses read-only arrays, so the view is writeable)."""
    zero, strides = zeros_like(param, 1), (0,) * param.ndim
    if isinstance(zero, np.ndarray):
        return np.lib.stride_tricks.as_strided(zero, param.shape, strides, subok=True)
    return sys.modules["cupy"].lib.stride_tricks.as_strided(zero, param.shape, strides)
