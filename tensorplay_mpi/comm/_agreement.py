"""Agreement: every rank says whether its part failed, and all raise together or none does.

A check that only some ranks can fail (a bad argument on one rank, a full disk, a missing
file) must not leave the other ranks waiting in their next collective.  :func:`agree` is the one
way the library decides such a point: one ``Iallgather`` of a fixed-size row per rank carrying
whether the rank failed (and with what kind of exception and message), a few integers and a
short text.  Then

- a rank whose part failed raises its own exception, unchanged;
- every other rank raises an exception of the same kind naming the ranks that failed and the
  first one's message: ``rank 0: DataParallel argument check failed on rank(s) [1] (rank 1:
  ValueError: ...)``;
- when no rank failed, every rank gets every rank's integers and text, the same on every rank,
  so a comparison of them (different shapes, different signatures) raises on all ranks alike.

The caller starts the gather, on the path its communicator needs (the library's collectives on
a guarded communicator, a guard's private one, the test verdicts' one), and gives the deadline.
The argument checks of the library's joinables, the checkpoint's agreements, the debug mode's
signature checks and the test verdicts of :mod:`tensorplay_mpi.testing` all decide here, and
:func:`agree_on_setting` the settings that must be the same on every rank.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np
from mpi4py import MPI

from ._work import Work

KINDS: tuple[type[Exception], ...] = (RuntimeError, TypeError, ValueError, OSError,
                                      AssertionError)
"""The kinds of exception the other ranks raise for a rank's failure: code ``c`` (from
:func:`kind_code`) is ``KINDS[c - 1]``, the nearest of them among the failure's base classes
(``FileNotFoundError`` arrives as ``OSError``); 0 means no failure."""

TEXT_BYTES = 512
"""Bytes of text (a failure's message, or the caller's text) a rank contributes by default."""

_HEADER = 3  # int64 words: kind code, text length, number of values
_SHOWN = 3  # failed ranks whose message the others' exception quotes


def kind_code(error: BaseException) -> int:
    """The code of `error`'s kind in :data:`KINDS` (``RuntimeError``'s when none is a base)."""
    mro = type(error).__mro__
    matches = [k for k in KINDS if k in mro]
    return 1 + KINDS.index(min(matches, key=mro.index) if matches else RuntimeError)


class Agreement(NamedTuple):
    """What every rank contributed, when none failed (the same on every rank)."""

    values: np.ndarray
    """``int64[size, len(values)]``: row ``r`` holds rank ``r``'s values."""
    texts: list[str]
    """Rank ``r``'s text (clipped to the agreed number of bytes)."""


def _text_of(error: BaseException, rank: int) -> str:
    """``Kind: message``, without the message's own ``rank N:`` prefix (the others name it)."""
    message = str(error)
    prefix = f"rank {rank}: "
    return f"{type(error).__name__}: {message.removeprefix(prefix)}"


def agree(start: Callable[[np.ndarray, np.ndarray], Work], rank: int, size: int, what: str,
          timeout: float, error: BaseException | None = None, values: Sequence[int] = (),
          text: str = "", text_bytes: int = TEXT_BYTES) -> Agreement:
    """Gather every rank's verdict on `what`; raise on every rank if any rank failed.

    Collective: every rank of the communicator that `start` gathers over must call it at the
    same point, with the same number of `values` and the same `text_bytes`.

    Parameters
    ----------
    start : callable
        ``start(row, every)`` starts an ``Iallgather`` of this rank's ``row`` into ``every``
        (``int64[size, len(row)]``) and returns its :class:`~tensorplay_mpi.comm.Work`.
    rank, size : int
        This rank and the number of ranks.
    what : str
        What is agreed on, for messages (``"checkpoint write (manifest)"``).
    timeout : float
        Seconds the gather may take (then the job is aborted, as every library wait).
    error : BaseException, optional
        This rank's failure; its kind and message travel to the other ranks.
    values : sequence of int
        Integers (int64) every rank learns from every rank.
    text : str
        A text every rank learns from every rank (ignored when `error` is given).
    text_bytes : int, default :data:`TEXT_BYTES`
        Bytes of text (or message) a rank sends; longer ones are clipped.

    Returns
    -------
    Agreement
        Every rank's values and text, when no rank failed.

    Raises
    ------
    BaseException
        `error` itself, on the rank that gave it.
    Exception
        On the other ranks, when some rank failed: of that rank's kind (:data:`KINDS`),
        naming the failed ranks and quoting their messages.
    """
    words = _HEADER + len(values) + -(-text_bytes // 8)
    row = np.zeros(words, dtype=np.int64)
    payload = (_text_of(error, rank) if error is not None else text).encode()[:text_bytes]
    row[:_HEADER] = (0 if error is None else kind_code(error), len(payload), len(values))
    row[_HEADER:_HEADER + len(values)] = values
    row.view(np.uint8)[8 * (_HEADER + len(values)):][:len(payload)] = np.frombuffer(
        payload, dtype=np.uint8)
    every = np.empty((size, words), dtype=np.int64)
    start(row, every).wait_or_abort(timeout)
    if error is not None:
        raise error
    texts = [every[r].view(np.uint8)[8 * (_HEADER + len(values)):][:int(every[r, 1])]
             .tobytes().decode(errors="replace") for r in range(size)]
    failed = np.flatnonzero(every[:, 0]).tolist()
    if failed:
        quoted = "; ".join(f"rank {r}: {texts[r]}" for r in failed[:_SHOWN])
        more = f"; {len(failed) - _SHOWN} more" if len(failed) > _SHOWN else ""
        raise KINDS[int(every[failed[0], 0]) - 1](
            f"rank {rank}: {what} failed on rank(s) {failed} ({quoted}{more})")
    return Agreement(every[:, _HEADER:_HEADER + len(values)].copy(), texts)


def agree_on_setting(start: Callable[[np.ndarray, np.ndarray], Work], rank: int, size: int,
                     timeout: float, on: bool, variable: str, why: str,
                     error: BaseException | None = None) -> None:
    """Raise ``ValueError`` on every rank unless what `variable` decided here (`on`) is the same
    on every rank.

    Collective, as :func:`agree` (`start`, `rank`, `size`, `timeout`, `error` are its own).
    The message lists the ranks on each side (with their ``COMM_WORLD`` ranks too where these
    differ from them: a sub-communicator) and says `why` the setting must agree.
    """
    every = agree(start, rank, size, f"the {variable} check", timeout, error,
                  [int(on), MPI.COMM_WORLD.Get_rank()]).values
    if every[:, 0].min() == every[:, 0].max():
        return
    world = any(w != r for r, w in enumerate(every[:, 1].tolist()))  # a sub-communicator
    on_ranks, off_ranks = (", ".join(f"{r} (world rank {w})" if world else str(r)
                                     for r, (flag, w) in enumerate(every.tolist()) if flag == side)
                           for side in (1, 0))
    raise ValueError(f"rank {rank}: {variable} is on for ranks {on_ranks} and off for ranks "
                     f"{off_ranks}; {why}, so set it the same on every rank (in the job's "
                     f"environment, before mpiexec or srun)")


def same_everywhere(start: Callable[[np.ndarray], Work], value: int, timeout: float) -> bool:
    """Whether every rank passed the same int64 `value` (a :func:`layout_digest`, say).

    Collective: `start` starts an in-place MAX allreduce of the int64 pair ``[value, -value]``
    on the caller's path (a communicator, or a JoinableComm whose joined ranks contribute the
    identity); the values agree iff the maximum is minus the maximum of their negations.  One
    message of 16 bytes, whatever the number of ranks.
    """
    pair = np.array([value, -value], np.int64)
    start(pair).wait_or_abort(timeout)
    return bool(pair[0] == -pair[1])
