"""Gradient buckets: flat per-dtype buffers that the gradients of several parameters share."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..buffers import zeros_like
from ..tensors import as_array

__all__ = ["Bucket", "GradientViews", "make_buckets"]


class Bucket:
    """One flat gradient buffer and the parameters whose gradients live in it.

    ``flat`` holds the gradients, then one "used" flag per member (1 where this rank produced
    a gradient, 0 where not): the bucket's allreduce sums them with the gradients, so every
    rank learns how many ranks used each parameter without a message of its own.
    """

    __slots__ = ("flat", "members", "index", "flags", "all_used", "_zeros")

    def __init__(self, like: Any, members: list[int], sizes: list[int]) -> None:
        n = sum(sizes)
        self.flat = zeros_like(like, n + len(members))  # on the device and kind of `like`
        self.members = members  # parameter indices, in fill (reverse parameter) order
        self.index = np.asarray(members, dtype=np.intp)
        self.flags = self.flat[n:]  # the "used" flags, summed with the gradients
        self.all_used = True  # every member was used by some rank in the last step
        self._zeros: np.ndarray | None = None

    def read_flags(self) -> np.ndarray:
        """The flags as a NumPy array (copied to the host from a device bucket)."""
        flags = self.flags
        return flags if type(flags) is np.ndarray else flags.get()

    def write_flags(self, has: np.ndarray) -> None:
        """Set the flags from booleans on the host."""
        if type(self.flags) is np.ndarray:
            self.flags[...] = has
        else:
            self.flags.set(has.astype(self.flags.dtype))

    @property
    def zeros(self) -> np.ndarray:
        """A joined rank's contribution: made on first use (by joined ranks only), then reused."""
        if self._zeros is None:
            self._zeros = zeros_like(self.flat)
        return self._zeros


def make_buckets(params: list[np.ndarray], cap_bytes: float,
                 frozen: Sequence[bool] = ()) -> tuple[list[Bucket], list[int], list[np.ndarray]]:
    """Pack gradients of `params` into buckets of at most `cap_bytes` (one set per dtype).

    Buckets fill in reverse parameter order, the order a backward pass produces gradients;
    a parameter larger than the cap gets a bucket of its own.  A parameter flagged in
    `frozen` gets no bucket (its bucket index is -1) and a zero gradient that holds
    no memory (a zero-stride view of one element).

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
        bucket = Bucket(params[members[0]], members, [params[i].size for i in members])
        offset = 0
        for i in members:
            size = params[i].size
            views[i] = bucket.flat[offset:offset + size].reshape(params[i].shape)
            bucket_of[i] = k
            offset += size
        buckets.append(bucket)
    return buckets, bucket_of, [views[i] for i in range(len(params))]


def _no_gradient(param: Any) -> np.ndarray:
    """A frozen parameter's gradient: zeros of its shape in one element of memory (frozen
    parameters are torch parameters, so on the CPU; torch refuses read-only arrays)."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, param.dtype), param.shape,
                                           (0,) * param.ndim)


_VIEWS_OF_MEMORY: "weakref.WeakValueDictionary[tuple, GradientViews]" = \
    weakref.WeakValueDictionary()
"""(data address, shape) of the first view -> its GradientViews, while they live: how an
optimizer given ``dp.grads`` or ``list(dp.grads)`` finds its DataParallel
(:meth:`GradientViews.of`).  Owned by :class:`GradientViews`, which registers itself."""


def _memory(array: Any) -> tuple:
    array = as_array(array)
    interface = getattr(array, "__array_interface__", None) or getattr(
        array, "__cuda_array_interface__", {})
    return interface.get("data", (None,))[0], getattr(array, "shape", None)


class GradientViews(Sequence):
    """The gradients, as views into the buckets: read them, write into them, never rebind.

    ``grads[i]`` is an array (a torch tensor for torch parameters) shaped like parameter ``i``
    (use it as ``out=``, or write ``grads[i][...] = g``); ``grads[i] = g`` copies `g` into it
    after checking its shape.

    The optimizer bound to these gradients last is the one that steps with them: binding a
    new one (``opt = SGD(params, dp.grads)`` after an Adam) replaces the previous one at once,
    whatever still references it.  When it holds state, every Join of their DataParallel must
    list it too (:meth:`check_optimizer`).
    """

    def __init__(self, views: list[np.ndarray], owner: Any = None) -> None:
        self._views = tuple(views)
        self._owner = None if owner is None else weakref.ref(owner)
        self._optimizer: weakref.ref | None = None  # the optimizer bound last, if it must join
        self._checked: weakref.ref | None = None  # the Join checked last
        if self._views:
            _VIEWS_OF_MEMORY[_memory(self._views[0])] = self

    @staticmethod
    def of(grads: Any) -> "GradientViews | None":
        """The GradientViews `grads` is, or whose views it holds (``list(dp.grads)``), else
        ``None``: an optimizer bound to copies of the list is still recognised."""
        if isinstance(grads, GradientViews):
            return grads
        views = _VIEWS_OF_MEMORY.get(_memory(grads[0])) if len(grads) else None
        if views is None or len(views) != len(grads):
            return None
        return views if all(g is v for g, v in zip(grads, views)) else None

    @property
    def owner(self) -> Any:
        """The DataParallel these gradients belong to (None if unknown or collected)."""
        return None if self._owner is None else self._owner()

    def bind(self, optimizer: Any, must_join: bool) -> None:
        """`optimizer` steps with these gradients from now on, replacing any bound before.

        `must_join`: it holds state (or communicates), so it must be in every Join.
        """
        self._optimizer = weakref.ref(optimizer) if must_join else None
        self._checked = None

    def stateful_optimizer(self) -> Any:
        """The optimizer bound last, if it must be in every Join (else None)."""
        return None if self._optimizer is None else self._optimizer()

    def check_optimizer(self, join: Any) -> None:
        """Raise ``RuntimeError`` if :meth:`stateful_optimizer` is missing from `join` (once
        per Join).  Deterministic from the Join's list, so every rank raises at the same point.
        """
        if join is None or (self._checked is not None and self._checked() is join):
            return
        optimizer = self.stateful_optimizer()
        if optimizer is not None and not any(j is optimizer for j in join.joinables):
            raise RuntimeError(
                f"{type(optimizer).__name__} holds optimizer state and steps with dp.grads, "
                f"but it is not in the Join: ranks that join early would skip its steps and "
                f"the replicas would diverge. List it after DataParallel: Join([dp, opt])")
        self._checked = weakref.ref(join)

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
            raise ValueError(f"grads[{index}] has shape {tuple(view.shape)}, got an array of shape "
                             f"{tuple(shape)}")
        as_array(view)[...] = as_array(value)

    def __repr__(self) -> str:
        return f"GradientViews({[v.shape for v in self._views]})"
