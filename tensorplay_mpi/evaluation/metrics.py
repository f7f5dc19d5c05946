"""Evaluation metrics over uneven shards: torchmetrics synced over MPI, and NumPy metric states.

Two ways to evaluate a validation set split unevenly over the ranks, each sample counted once:

- **torchmetrics**: :func:`gather_all_tensors` has the signature of torchmetrics'
  ``dist_sync_fn`` and :func:`distributed_available` that of its ``distributed_available_fn``;
  ``Metric(**sync_options(jc))`` passes both, with ``process_group=jc``.  The metric then syncs
  over MPI without ``torch.distributed``.  Inside a Join, pass the :class:`JoinableComm` that
  is in the Join: a per-step sync (``dist_sync_on_step=True``) is then shadowed by the ranks
  that have joined, and gathers the batches of the active ranks only.
- **NumPy**: keep running states (sums, counts, a :func:`confusion_matrix`, the sum of the loss
  and the number of samples for a running mean) and add them over the ranks with
  :func:`reduce_states`, inside a Join (through its JoinableComm) or after it.

Wire schedule of :func:`gather_all_tensors`: each rank packs one header (its rank, the dtype
code, the number of dimensions and the shape, ``int64[11]``) and its data into one byte row,
padded to 8 bytes; one allgather of the rows (an ``Iallgather`` of the row counts and an
``Iallgatherv``; announced first when ranks have joined) gives every rank the others'
tensors.  Ranks that have joined contribute no row: the list holds the active ranks' tensors.
Integer states thus travel exactly; :func:`reduce_states` first compares a digest of the
states' names, shapes and kinds (``Iallreduce(int64[2], MAX)`` of ``[digest, -digest]``), then
sums integers in int64 and floats in float64, two allreduces started together.  The check comes
first and alone: states that differ between ranks would give allreduces of different counts,
which MPI does not detect (it returns wrong numbers).
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Any, Mapping

import numpy as np
from mpi4py import MPI

from ..algorithms.join import Join
from ..algorithms._joinable_comm import JoinableComm
from ..comm._agreement import same_everywhere
from ..comm._digests import layout_digest
from ..comm._collectives import (check_comm, default_comm, default_timeout, iallgather, iallgatherv,
                                 iallreduce)
from ..comm._tensors import as_array, host_array, is_tensor
from ..comm._work import Work

__all__ = ["gather_all_tensors", "distributed_available", "sync_options", "SyncGroup",
           "reduce_states", "StatesDiffer", "confusion_matrix"]

_DTYPES = tuple(np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128))
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
_MAX_DIMS = 8
_HEADER = 3 + _MAX_DIMS  # rank, dtype code, ndim, shape
_HEADER_BYTES = 8 * _HEADER


def distributed_available() -> bool:
    """Whether MPI runs with more than one rank in the default communicator.

    torchmetrics' ``distributed_available_fn``: a metric syncs only when this is true.
    """
    return MPI.Is_initialized() and not MPI.Is_finalized() and default_comm().Get_size() > 1


def group_of(group: Any) -> JoinableComm | MPI.Intracomm:
    """The group a metric or layer reduces over: a :class:`JoinableComm` as given, a
    :class:`SyncGroup`'s group, else a checked communicator (``None``: the default one)."""
    if isinstance(group, SyncGroup):
        group = group.group
    if isinstance(group, JoinableComm):
        return group
    return check_comm(default_comm() if group is None else group, "group")


class SyncGroup:
    """The ``process_group`` that :func:`sync_options` puts in a metric: its group (a
    :class:`JoinableComm` or a communicator) in a handle that pickles.

    A communicator cannot be pickled: a metric pickled and loaded again syncs over the default
    communicator (``MPI.COMM_WORLD``) until it is given its group again, ``metric.process_group
    = SyncGroup(jc)`` (inside a Join, the Join's JoinableComm; its sync there raises
    ``RuntimeError`` before any collective until then).  A copy (``metric.clone()``)
    shares the group, as it shares ``MPI.COMM_WORLD``.
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group_of(group)

    def __reduce__(self) -> tuple:
        return SyncGroup, ()

    def __deepcopy__(self, memo: dict) -> "SyncGroup":
        return self


class _MoreThanOneRank:
    """torchmetrics' ``distributed_available_fn`` for a group: picklable, unlike a lambda."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self) -> bool:
        return self.size > 1


def group_size(group: JoinableComm | MPI.Intracomm) -> int:
    """The number of ranks of a :func:`group_of` group."""
    return group.size if isinstance(group, JoinableComm) else group.Get_size()


def sync_options(group: Any = None) -> dict[str, Any]:
    """The keyword arguments that make a torchmetrics ``Metric`` sync through `group`.

    Parameters
    ----------
    group : JoinableComm or mpi4py.MPI.Intracomm, optional
        Inside a Join, the :class:`JoinableComm` that is in the Join; else any communicator
        (default ``MPI.COMM_WORLD``).

    Returns
    -------
    dict
        ``dist_sync_fn``, ``distributed_available_fn`` (true when `group` has more than one
        rank) and ``process_group`` (a :class:`SyncGroup`):
        ``MulticlassAccuracy(num_classes=10, **sync_options(jc))``.  The metric pickles; a
        loaded one syncs over the default communicator until given its group again (see
        :class:`SyncGroup`).
    """
    handle = SyncGroup(group)
    return {"dist_sync_fn": gather_all_tensors,
            "distributed_available_fn": _MoreThanOneRank(group_size(handle.group)),
            "process_group": handle}


def overlap(group: MPI.Intracomm, comm: MPI.Intracomm) -> int:
    """How many processes are in both communicators (local: their groups compared)."""
    mine, theirs = group.Get_group(), comm.Get_group()
    try:
        found = MPI.Group.Translate_ranks(mine, list(range(mine.Get_size())), theirs)
    finally:
        mine.Free()
        theirs.Free()
    return sum(rank != MPI.UNDEFINED for rank in found)


def _refuse_inside_join(comm: MPI.Intracomm, what: str) -> None:
    """Raise RuntimeError, before any collective, when `what` runs over the plain `comm`
    inside a running Join over any of its ranks: a rank that has joined would not shadow it
    (on the Join's communicator its polls would match the collective and decode garbage)."""
    join = Join.current()
    # another of the Join's processes in `comm` may have joined (MPI.COMM_SELF: none can)
    if join is not None and overlap(comm, join.joinables[0].join_process_group) > 1:
        raise RuntimeError(
            f"{what} over a plain communicator inside a running Join, where ranks that have "
            f"joined cannot shadow it: pass the Join's JoinableComm instead (a torchmetrics "
            f"metric: `metric.process_group = SyncGroup(jc)`, which a pickled or loaded metric "
            f"needs again, as it syncs over MPI.COMM_WORLD until then), or sync after the Join")


def _packed(rank: int, data: np.ndarray) -> np.ndarray:
    """This rank's byte row: the header, then the data padded to a multiple of 8 bytes."""
    if data.ndim > _MAX_DIMS:
        raise ValueError(f"gather_all_tensors takes tensors of up to {_MAX_DIMS} dimensions, "
                         f"got shape {data.shape}")
    code = _DTYPE_CODES.get(data.dtype)
    if code is None:
        raise TypeError(f"gather_all_tensors cannot send dtype {data.dtype}")
    header = np.zeros(_HEADER, np.int64)
    header[:3] = rank, code, data.ndim
    header[3:3 + data.ndim] = data.shape
    row = np.zeros(_HEADER_BYTES + 8 * math.ceil(data.nbytes / 8), np.uint8)
    row[:_HEADER_BYTES] = header.view(np.uint8)
    row[_HEADER_BYTES:_HEADER_BYTES + data.nbytes] = np.ascontiguousarray(data).reshape(
        -1).view(np.uint8)
    return row


def _unpacked(rows: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """The (rank, array) pairs of gathered byte rows, in rank order (views of `rows`)."""
    pairs, offset = [], 0
    while offset < rows.size:
        header = rows[offset:offset + _HEADER_BYTES].view(np.int64)
        rank, code, ndim = (int(v) for v in header[:3])
        shape = tuple(int(v) for v in header[3:3 + ndim])
        dtype = _DTYPES[code]
        nbytes = math.prod(shape) * dtype.itemsize
        start = offset + _HEADER_BYTES
        pairs.append((rank, rows[start:start + nbytes].view(dtype).reshape(shape)))
        offset = start + 8 * math.ceil(nbytes / 8)
    return pairs


def _allgather_bytes(comm: MPI.Intracomm, row: np.ndarray) -> np.ndarray:
    """Every rank's byte row over a plain communicator, concatenated in rank order."""
    timeout = default_timeout()
    counts = np.empty(comm.Get_size(), np.int64)
    work = iallgather(comm, np.array([row.size], np.int64), counts, "metric row sizes")
    work.wait_or_abort(timeout)
    out = np.empty(int(counts.sum()), np.uint8)
    work = iallgatherv(comm, row, out, counts.tolist(), "metric rows")
    work.wait_or_abort(timeout)
    return out


def gather_all_tensors(result: Any, group: Any = None) -> list[Any]:
    """Every rank's `result`, in rank order: torchmetrics' ``dist_sync_fn`` over MPI.

    Collective over `group`: every rank must call it (inside a Join, every active rank, once
    per :meth:`JoinableComm.begin_iteration` in which the others call it).  The tensors may
    differ in shape (the first dimension, as torchmetrics' cat states, or any other) and are
    sent exactly, through the host; each comes back on `result`'s device, and this rank's
    entry is `result` itself (its autograd graph kept, as torchmetrics does).  An empty tensor
    of another dtype than every non-empty one (a rank without samples holds a metric's
    float32 default state) comes back in theirs, so that a concatenation keeps their dtype.

    Parameters
    ----------
    result : torch.Tensor or numpy.ndarray
        This rank's tensor (a NumPy array gives a list of NumPy arrays).
    group : JoinableComm or mpi4py.MPI.Intracomm, optional
        Inside a Join, the :class:`JoinableComm` that is in the Join: ranks that have joined
        shadow the gather and contribute nothing, so the list holds the active ranks'
        tensors.  Outside a Join any communicator; default ``MPI.COMM_WORLD``.

    Raises
    ------
    TypeError
        For a dtype NumPy and MPI cannot carry (bfloat16, say), or a `group` of another kind.
    ValueError
        For a tensor of more than 8 dimensions.
    RuntimeError
        Over a plain communicator inside a running Join on any of its ranks (a loaded metric
        not given its :class:`SyncGroup` back), before any collective.
    """
    checked = group_of(group)
    torch = sys.modules.get("torch") if is_tensor(result) else None
    host = result.detach().cpu().contiguous() if torch is not None else result
    data = np.asarray(as_array(host, "result"))
    if isinstance(checked, JoinableComm):
        row = _packed(checked.rank, data)
        rows = checked.allgather(row)
        rank = checked.rank
    else:
        _refuse_inside_join(checked, "gather_all_tensors (a metric's sync)")
        rank = checked.Get_rank()
        rows = _allgather_bytes(checked, _packed(rank, data))
    pairs = _unpacked(rows)
    kinds = {array.dtype for _, array in pairs if array.size}
    kind = kinds.pop() if len(kinds) == 1 else None  # of every rank that holds values
    gathered: list[Any] = []
    for owner, array in pairs:
        if kind is not None and not array.size and array.dtype != kind:
            array = array.astype(kind)  # an empty rank's default state: the others' dtype,
            if owner == rank and torch is not None:  # so that a concatenation keeps it
                result = result.to(torch.from_numpy(array).dtype)
            elif owner == rank:
                result = array
        if owner == rank:
            gathered.append(result)
        elif torch is not None:
            gathered.append(torch.from_numpy(array.copy()).to(result.device))
        else:
            gathered.append(array.copy())
    return gathered


def _start_reduce(group: JoinableComm | MPI.Intracomm, values: np.ndarray, op: MPI.Op,
                  what: str) -> Work:
    if isinstance(group, JoinableComm):
        return group.iallreduce(values, op, out=values)
    return iallreduce(group, MPI.IN_PLACE, values, op, what)


class StatesDiffer(ValueError):
    """Ranks passed different states to :func:`reduce_states` (raised on every rank), so that
    a layer built on it can say what that means for its users."""


def _check_layout(group: JoinableComm | MPI.Intracomm, arrays: Mapping[str, np.ndarray],
                  timeout: float) -> None:
    """Raise ``ValueError`` on every rank unless every (active) rank passes the same names,
    shapes and kinds (integer or floating) to :func:`reduce_states`."""
    layout = [(name, arrays[name].shape, arrays[name].dtype.kind in "biu")
              for name in sorted(arrays)]
    start = functools.partial(_start_reduce, group, op=MPI.MAX,
                              what="reduce_states (layout check)")
    if not same_everywhere(start, layout_digest(layout), timeout):
        mine = ", ".join(f"{name!r}: {shape} {'int' if exact else 'float'}"
                         for name, shape, exact in layout)
        raise StatesDiffer(f"reduce_states: ranks passed different states (names, shapes or "
                            f"integer/floating kinds); pass the same on every rank. This rank "
                            f"passed {{{mine}}}")


def reduce_states(states: Mapping[str, Any], comm: Any = None, *,
                  check: bool = True) -> dict[str, Any]:
    """The sum over ranks of each running metric state: counts exactly, floats in float64.

    Collective over `comm`: every rank must call it with the same names, shapes and kinds
    (inside a Join, every active rank in the same iteration); that is checked first, with one
    small allreduce, unless `check` is False.  Integer and bool states are then summed as
    int64 (exact), floating ones as float64, in two allreduces started together.

    Parameters
    ----------
    states : mapping of str to array or number
        This rank's states: sums, counts, a :func:`confusion_matrix`, the sum of the loss and
        the number of samples (their quotient after the reduction is the running mean).
    comm : JoinableComm or mpi4py.MPI.Intracomm, optional
        Inside a Join, the :class:`JoinableComm` in the Join (joined ranks add zeros);
        outside one, any communicator (default ``MPI.COMM_WORLD``).
    check : bool, default True
        Compare the names, shapes and kinds across ranks before summing (one
        ``Iallreduce(int64[2])`` waited for first).  Pass False only where every rank is known
        to pass the same layout (a loop that checked it in its first iteration).

    Returns
    -------
    dict
        Each name's global sum, shaped as given (a 0-d state as a NumPy scalar).

    Raises
    ------
    TypeError
        For a state that is not real numbers (complex, objects).
    ValueError
        On every rank, when ranks passed different names, shapes or kinds (`check`).
    RuntimeError
        Over a plain communicator inside a running Join on any of its ranks, before any
        collective: pass the Join's JoinableComm.

    Examples
    --------
    ::

        totals = reduce_states({"loss": loss_sum, "count": n, "cm": cm}, jc)
        mean_loss = totals["loss"] / totals["count"]
    """
    group = group_of(comm)
    if not isinstance(group, JoinableComm):
        _refuse_inside_join(group, "reduce_states")
    arrays = {name: host_array(value, name) for name, value in states.items()}
    for name, array in arrays.items():
        if array.dtype.kind not in "biuf":
            raise TypeError(f"reduce_states sums integer, bool and floating states; {name!r} "
                            f"has dtype {array.dtype}")
    timeout = group.timeout if isinstance(group, JoinableComm) else default_timeout()
    if check:
        _check_layout(group, arrays, timeout)
    names = sorted(arrays)
    exact = [name for name in names if arrays[name].dtype.kind in "biu"]
    floating = [name for name in names if arrays[name].dtype.kind == "f"]
    buffers, works = [], []
    for chosen, dtype in ((exact, np.int64), (floating, np.float64)):
        flat = np.concatenate([arrays[n].astype(dtype).reshape(-1) for n in chosen]) \
            if chosen else np.zeros(0, dtype)
        buffers.append(flat)
        if chosen:  # every rank passes the same names: the same allreduces
            works.append(_start_reduce(group, flat, MPI.SUM,
                                       f"reduce_states ({np.dtype(dtype).name})"))
    for work in works:
        work.wait_or_abort(timeout)
    reduced: dict[str, Any] = {}
    for chosen, flat in zip((exact, floating), buffers):
        offset = 0
        for name in chosen:
            size = arrays[name].size
            value = flat[offset:offset + size].reshape(arrays[name].shape)
            reduced[name] = value[()] if value.ndim == 0 else value
            offset += size
    return {name: reduced[name] for name in states}


def confusion_matrix(y_true: Any, y_pred: Any, num_classes: int) -> np.ndarray:
    """This rank's confusion matrix: ``cm[t, p]`` counts samples of class ``t`` predicted ``p``.

    Local (no communication): add it to a running state and sum that with
    :func:`reduce_states`.  int64, rows the true classes as in scikit-learn.

    Raises
    ------
    ValueError
        If the labels differ in length or lie outside ``[0, num_classes)``.
    """
    true = host_array(y_true, "y_true").reshape(-1)
    pred = host_array(y_pred, "y_pred").reshape(-1)
    if true.size != pred.size:
        raise ValueError(f"y_true and y_pred differ in length: {true.size} and {pred.size}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    for name, labels in (("y_true", true), ("y_pred", pred)):
        if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
            raise ValueError(f"{name} has labels outside [0, {num_classes}): "
                             f"{labels.min()}..{labels.max()}")
    index = true.astype(np.int64) * num_classes + pred.astype(np.int64)
    return np.bincount(index, minlength=num_classes * num_classes).reshape(
        num_classes, num_classes)

