"""Gradient buckets: flat per-dtype buffers that the gradients of several parameters share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..buffers import zeros_like

__all__ = ["Bucket", "GradientViews", "make_buckets"]


class Bucket:
    """One flat gradient buffer and the parameters whose gradients live in it."""

    __slots__ = ("flat", "members", "_zeros")

    def __init__(self, like: Any, members: list[int], sizes: list[int]) -> None:
        self.flat = zeros_like(like, sum(sizes))  # on the device and of the kind of `like`
        self.members = members  # parameter indices, in fill (reverse parameter) order
        self._zeros: np.ndarray | None = None

    @property
    def zeros(self) -> np.ndarray:
        """A joined rank's contribution: made on first use (by joined ranks only), then reused."""
        if self._zeros is None:
            self._zeros = zeros_like(self.flat)
        return self._zeros


def make_buckets(params: list[np.ndarray], cap_bytes: float) -> tuple[list[Bucket], list[int],
                                                                       list[np.ndarray]]:
    """Pack gradients of `params` into buckets of at most `cap_bytes` (one set per dtype).

    Buckets fill in reverse parameter order, the order a backward pass produces gradients;
    a parameter larger than the cap gets a bucket of its own.

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
    for index in reversed(range(len(params))):
        param = params[index]
        current, used = filling.get(param.dtype, (None, 0))
        if current is None or used + param.nbytes > cap_bytes:
            current, used = len(plans), 0
            plans.append((param.dtype, []))
        plans[current][1].append(index)
        filling[param.dtype] = (current, used + param.nbytes)

    buckets, bucket_of, views = [], [0] * len(params), [None] * len(params)
    for k, (_, members) in enumerate(plans):
        bucket = Bucket(params[members[0]], members, [params[i].size for i in members])
        offset = 0
        for i in members:
            size = params[i].size
            views[i] = bucket.flat[offset:offset + size].reshape(params[i].shape)
            bucket_of[i] = k
            offset += size
        buckets.append(bucket)
    return buckets, bucket_of, views


class GradientViews(Sequence):
    """The gradients, as views into the buckets: read them, write into them, never rebind.

    ``grads[i]`` is an array shaped like parameter ``i`` (use it as ``out=``, or write
    ``grads[i][...] = g``); ``grads[i] = g`` copies `g` into it after checking its shape.
    """

    def __init__(self, views: list[np.ndarray]) -> None:
        self._views = tuple(views)

    def __len__(self) -> int:
        return len(self._views)

    def __getitem__(self, index: Any) -> Any:
        return self._views[index]

    def __setitem__(self, index: int, value: Any) -> None:
        view = self._views[index]
        shape = getattr(value, "shape", None)
        if shape is None:
            shape = np.shape(value)
        if tuple(shape) != view.shape:
            raise ValueError(f"grads[{index}] has shape {view.shape}, got an array of shape "
                             f"{tuple(shape)}")
        view[...] = value

    def __repr__(self) -> str:
        return f"GradientViews({[v.shape for v in self._views]})"
