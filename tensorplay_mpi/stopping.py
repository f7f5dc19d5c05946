"""Stop requests: a signal or a call asks this rank to stop; a Join makes it every rank's stop.

A request is only a process-wide flag.  Nothing collective runs when it is made (a signal
handler sets the flag and returns); the next heartbeat of an enabled
:class:`~tensorplay_mpi.Join` carries it to every rank, which then sees
:attr:`Join.stopped <tensorplay_mpi.Join.stopped>` become true at the same iteration.  The
documentation's "Stopping and resuming" page has the whole loop, checkpoint included.
"""

from __future__ import annotations

import contextlib
import signal
from types import FrameType
from typing import Iterable, Iterator

from ._resets import register

__all__ = ["stop_on_signals", "keep_stop_signals", "request_stop", "stop_requested", "clear_stop",
           "request_save", "save_requested", "clear_save", "REQUEUE_STATUS"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
"""What Slurm sends at the time limit (SIGTERM), what ``--signal`` and ``scancel --signal``
are usually set to send before it (SIGUSR1), and Ctrl-C (SIGINT)."""

REQUEUE_STATUS = 75
"""``EX_TEMPFAIL`` of ``sysexits.h``, "try again": the status of a job that stopped with a
checkpoint, on which a batch script requeues it (neither success, so that ``afterok``
dependencies wait, nor a failure)."""

_pending: dict[str, str | None] = {"stop": None, "save": None}  # this rank's requests: why


def _ask(kind: str, reason: str) -> None:
    """Note this rank's `kind` of request, keeping the first request's reason."""
    if not isinstance(reason, str):
        raise TypeError(f"reason must be a string, got {type(reason).__name__}")
    if _pending[kind] is None:
        _pending[kind] = reason


def request_stop(reason: str = "request_stop()") -> None:
    """Ask for a coordinated stop from this rank (the first request's reason is kept).

    Local: it only sets a flag, so it is safe anywhere, signal handlers included.

    Raises
    ------
    TypeError
        If `reason` is not a string.
    """
    _ask("stop", reason)


def request_save(reason: str = "request_save()") -> None:
    """Ask for a checkpoint from this rank at the next iteration boundary of every rank.

    Local, like :func:`request_stop`: it only sets a flag.  The next heartbeat (or poll) of an
    enabled :class:`~tensorplay_mpi.Join` carries it; every rank, joined or not, then runs the
    Join's ``on_save`` at one iteration boundary, and the request is withdrawn on every rank as
    ``on_save`` starts: that save serves every request made before it (several make one save;
    one made during ``on_save`` asks for the next save), and an ``on_save`` that raises makes it
    pending again.  A request that no ``on_save`` served (a Join without one, or one that
    stopped first, where ``join.save_due`` tells the caller to save) is not withdrawn: it stays
    pending for the next Join's ``on_save``, or until :func:`clear_save`.

    Raises
    ------
    TypeError
        If `reason` is not a string.
    """
    _ask("save", reason)


def stop_requested() -> str | None:
    """This rank's own pending stop request (its reason), else ``None``; not coordinated."""
    return _pending["stop"]


def save_requested() -> str | None:
    """This rank's own pending save request (its reason), else ``None``; not coordinated."""
    return _pending["save"]


def clear_stop() -> None:
    """Withdraw this rank's stop request (after a stop was handled, to go on)."""
    _pending["stop"] = None


def clear_save() -> None:
    """Withdraw this rank's save request (a Join does it once it served the save)."""
    _pending["save"] = None


register(clear_stop, "requests")
register(clear_save, "requests")


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if signum == signal.SIGINT and _pending["stop"] is not None:
        raise KeyboardInterrupt  # Ctrl-C while a stop is pending: stop now, as Python would
    request_stop(signal.Signals(signum).name)


def _signals(signals: Iterable[int], who: str) -> list[signal.Signals]:
    chosen = []
    for signum in signals:
        if isinstance(signum, bool) or not isinstance(signum, int):
            raise TypeError(f"{who} takes signal numbers (signal.SIGTERM, ...), got "
                            f"{type(signum).__name__} {signum!r}")
        chosen.append(signal.Signals(signum))
    return chosen


def keep_stop_signals(signals: Iterable[int] = STOP_SIGNALS) -> None:
    """Turn `signals` into stop requests from now until the program ends.

    The same handler as :func:`stop_on_signals`, never restored: call it first thing in the
    program (right after ``import tensorplay_mpi``), and a signal that arrives during the set-up,
    the final save or the report only sets a request instead of killing the job.  A
    :func:`stop_on_signals` block inside restores this handler when it exits.  Takes and raises
    what :func:`stop_on_signals` does.

    At exit (the process's exit hook, before ``MPI_Finalize``) these signals are ignored
    instead (:func:`ignore_kept_signals`): Python restores the default action of its handlers
    before mpi4py finalizes MPI, so a stop signal during ``MPI_Finalize`` would otherwise kill
    a job that has finished its work.
    """
    for signum in _signals(signals, "keep_stop_signals"):
        signal.signal(signum, _on_signal)


def ignore_kept_signals() -> None:
    """Ignore, from now on, every signal whose handler is still a stop request's: called at
    exit, when there is nothing left to stop (see :func:`keep_stop_signals`)."""
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is _on_signal:
            signal.signal(signum, signal.SIG_IGN)


@contextlib.contextmanager
def stop_on_signals(signals: Iterable[int] = STOP_SIGNALS) -> Iterator[None]:
    """Turn `signals` into stop requests inside the block; restore the previous handlers after.

    Inside the block each of `signals` only calls :func:`request_stop` with the signal's name
    (``"SIGTERM"``, ...): the enabled Joins of this process then stop every rank together.  A
    SIGINT while a stop is pending (Ctrl-C twice, or after a SIGTERM) raises
    ``KeyboardInterrupt`` as usual: an exception, so the job ends through the failure path.

    Parameters
    ----------
    signals : iterable of int, default (SIGTERM, SIGUSR1, SIGINT)
        Signal numbers (``signal.SIGTERM``, ...).

    Raises
    ------
    ValueError
        If called outside the main thread (Python delivers signals to the main thread only),
        or given a number that is no signal.
    OSError
        If given a signal that cannot be caught (``SIGKILL``, ``SIGSTOP``).
    TypeError
        If an element is not a signal number.
    """
    chosen = _signals(signals, "stop_on_signals")
    previous = {}
    try:
        for signum in chosen:
            previous[signum] = signal.signal(signum, _on_signal)
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

