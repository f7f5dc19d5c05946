"""The link between a DataParallel and the optimizer that steps with its gradients.

``dp.grads`` is a :class:`GradientViews`: the gradients, and the DataParallel they belong to.
An optimizer given ``dp.grads`` takes the link from there (:meth:`GradientViews.of`), and
records itself on it (:meth:`GradientViews.step_with`), so that the DataParallel knows which
optimizer steps with its gradients.  The link is passed, never looked up: a plain list of
arrays (``list(dp.grads)`` included) carries none.

:func:`check_places` is the one check of the link inside a Join: the DataParallel comes
before its optimizer, and an optimizer that holds state is in the Join at all.  It is
deterministic from the Join's list, so every rank raises at the same point.
"""

from __future__ import annotations

import sys

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..comm._collectives import default_comm
from ..comm._tensors import as_array, is_bfloat16

if TYPE_CHECKING:
    from mpi4py import MPI

    from ..algorithms.join import Join, Joinable


class Averaging(Protocol):
    """What an optimizer reads of the joinable that averages its gradients (DataParallel)."""

    comm: "MPI.Intracomm"
    used: np.ndarray
    """Per parameter: whether some rank produced a gradient for it in the last step."""


class GradientViews(Sequence):
    """The gradients, as views into the buckets: read them, write into them, never rebind.

    ``grads[i]`` is an array (a torch tensor for torch parameters) shaped like parameter ``i``
    (use it as ``out=``, or write ``grads[i][...] = g``); ``grads[i] = g`` copies `g` into it
    after checking its shape.

    They carry the link to their DataParallel (:attr:`data_parallel`) and to the optimizer
    that steps with them: the one made with them last (``opt = SGD(params, dp.grads)`` after
    an Adam replaces the Adam at once, whatever still references it).  When it holds state,
    every Join of the DataParallel must list it too (:func:`check_places`).
    """

    def __init__(self, views: list[Any], data_parallel: Averaging) -> None:
        self._views = tuple(views)
        self._data_parallel = weakref.ref(data_parallel)  # it holds these views
        self._optimizer: weakref.ref | None = None  # the optimizer made last, if it must join

    @staticmethod
    def of(grads: Sequence[Any]) -> "GradientViews | None":
        """The link `grads` carries: `grads` itself when it is ``dp.grads``, else ``None``
        (any other sequence of arrays, ``list(dp.grads)`` included).

        Raises
        ------
        RuntimeError
            If `grads` is the ``dp.grads`` of a DataParallel that no longer exists.
        """
        if not isinstance(grads, GradientViews):
            return None
        if grads.data_parallel is None:
            raise RuntimeError("these dp.grads belong to a DataParallel that no longer exists: "
                               "keep the DataParallel alive while its optimizer steps")
        return grads

    @property
    def data_parallel(self) -> Averaging | None:
        """The DataParallel these gradients belong to (``None`` once it is collected)."""
        return self._data_parallel()

    def step_with(self, optimizer: "Joinable", must_join: bool) -> None:
        """`optimizer` steps with these gradients from now on, replacing any before it.

        `must_join`: it holds state (or communicates), so it must be in every Join.
        """
        self._optimizer = weakref.ref(optimizer) if must_join else None

    @property
    def stateful_optimizer(self) -> "Joinable | None":
        """The optimizer made with these gradients last, if it must be in every Join."""
        return None if self._optimizer is None else self._optimizer()

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
        if is_bfloat16(view):  # no NumPy view: torch rounds to it
            view.copy_(sys.modules["torch"].as_tensor(value))
        else:
            as_array(view)[...] = as_array(value)

    def __repr__(self) -> str:
        return f"GradientViews({[v.shape for v in self._views]})"


def comm_of(link: GradientViews | None) -> "MPI.Intracomm":
    """The communicator of the DataParallel that `link` (``dp.grads``) belongs to, else the
    default (``MPI.COMM_WORLD``)."""
    data_parallel = None if link is None else link.data_parallel
    return default_comm() if data_parallel is None else data_parallel.comm


def used_of(link: GradientViews | None) -> np.ndarray | None:
    """``dp.used`` of the DataParallel that `link` belongs to (which parameters have a
    gradient after its last step), else ``None`` (all have)."""
    data_parallel = None if link is None else link.data_parallel
    return None if data_parallel is None else data_parallel.used


def position(join: "Join", joinable: Any) -> int | None:
    """The index of `joinable` in `join`'s list (by identity), ``None`` if it is not there."""
    for k, j in enumerate(join.joinables):
        if j is joinable:
            return k
    return None


def in_join(join: "Join", joinable: Any) -> bool:
    """Whether `joinable` is one of `join`'s joinables (by identity)."""
    return position(join, joinable) is not None


def check_places(join: "Join | None", optimizer: "Joinable | None",
                 link: GradientViews | None, must_join: bool) -> None:
    """Raise ``RuntimeError`` unless `optimizer`, which steps with the gradients `link`
    (``dp.grads``), has its place in `join`: the one check of the link, which DataParallel
    and the optimizers run before each heartbeat.

    Its place: after the DataParallel of `link` (after some joinable when `link` is ``None``:
    a plain list of gradients that an earlier joinable writes), when it is in `join`; and in
    `join` at all when `must_join` (it holds state: a rank that joined early would skip its
    steps).  Nothing to check without a Join or an optimizer.
    """
    if join is None or optimizer is None:
        return
    data_parallel = None if link is None else link.data_parallel
    joinables = join.joinables
    me = position(join, optimizer)
    if me is None:
        if must_join:
            raise RuntimeError(
                f"{type(optimizer).__name__} holds optimizer state and steps with dp.grads, "
                f"but it is not in the Join: ranks that join early would skip its steps and "
                f"the replicas would diverge. List it after DataParallel: Join([dp, opt])")
        return
    if data_parallel is None:
        placed = me > 0
    else:
        at = position(join, data_parallel)
        placed = at is not None and at < me
    if not placed:
        names = ", ".join(type(j).__name__ for j in joinables)
        raise RuntimeError(
            f"{type(optimizer).__name__} steps with the gradients that a DataParallel averages, "
            f"so that DataParallel must come before it in the Join: Join([dp, opt]) "
            f"(got Join([{names}]))")


class PlaceCheck:
    """:func:`check_places` for one caller, run again only when the Join or the optimizer
    differs from the last check that passed: a Join's list is fixed once made, so the check
    leaves the per-iteration path (where it cost about 1 us an iteration and joinable)."""

    __slots__ = ("_join", "_optimizer")

    def __init__(self) -> None:
        self._join: weakref.ref | None = None  # of the last check that passed
        self._optimizer: weakref.ref | None = None

    def __call__(self, join: "Join | None", optimizer: "Joinable | None",
                 link: GradientViews | None, must_join: bool) -> None:
        """Raise as :func:`check_places` does (the same arguments)."""
        if join is None or optimizer is None:
            return
        if self._join is not None and self._join() is join and self._optimizer is not None \
                and self._optimizer() is optimizer:
            return
        check_places(join, optimizer, link, must_join)
        self._join, self._optimizer = weakref.ref(join), weakref.ref(optimizer)
