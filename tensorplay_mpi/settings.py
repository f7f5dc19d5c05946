"""Every ``TENSORPLAY_MPI_*`` environment variable, parsed once and validated in one place.

==============================  ========================================  =========
variable                        meaning                                   default
==============================  ========================================  =========
``TENSORPLAY_MPI_TIMEOUT``      seconds a library wait may take           ``1800``
``TENSORPLAY_MPI_STALL``        seconds before a wait is reported; 0 off  ``60``
``TENSORPLAY_MPI_GRACE``        seconds the failure agreement may take    ``10``
``TENSORPLAY_MPI_DEBUG``        collective signature checks               ``0``
``TENSORPLAY_MPI_CUDA_AWARE``   device pointers to MPI: auto, 0 or 1      ``auto``
``TENSORPLAY_MPI_EXCEPTHOOK``   abort the job on an uncaught exception    ``1``
``TENSORPLAY_MPI_THREADS``      BLAS threads per rank: auto, keep or N    ``auto``
``TENSORPLAY_MPI_FUSED``        fused optimizer steps: auto, 0 or 1       ``auto``
``TENSORPLAY_MPI_PERSISTENT``   persistent collectives: auto, 0 or 1      ``auto``
==============================  ========================================  =========

The timeout and the stall report cover the library's own waits: a rank blocked in a library
call.  A deadlock entirely in your own code (rank 0 in ``comm.Barrier()``, rank 1 in
``comm.recv()``) is in no library wait, and only the launcher's or the scheduler's time limit
ends it.

Booleans accept ``1/true/yes/on`` and ``0/false/no/off`` (any case).  A value that is none of
the accepted ones raises ``ValueError`` naming the variable, at the first library call that
needs the settings, before that call starts anything.  Any other ``TENSORPLAY_MPI_*`` variable
(a misspelling such as ``TENSORPLAY_MPI_TIMOUT``) gets one ``RuntimeWarning`` from rank 0.

``TENSORPLAY_MPI_DEBUG`` and ``TENSORPLAY_MPI_PERSISTENT`` decide which collectives a rank
starts, so what they decide must be the same on every rank: debug mode is compared at the first
library use of a communicator, persistent collectives when a ``JoinableComm`` is made (``auto``
and ``1`` agree where MPI has them), and a difference raises ``ValueError`` on every rank,
listing the ranks on each side.  Set them in the job's environment, not per rank.
"""

from __future__ import annotations

import difflib
import math
import os
import warnings
from dataclasses import dataclass, fields
from functools import lru_cache

from ._resets import register

__all__ = ["Settings", "settings"]

_PREFIX = "TENSORPLAY_MPI_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Settings:
    """The library's settings, read from the environment by :func:`settings`."""

    timeout: float = 1800.0
    stall: float = 60.0
    """Seconds a library wait goes on before it is reported (once); 0 turns reports off."""
    grace: float = 10.0
    debug: bool = False
    cuda_aware: str = "auto"
    excepthook: bool = True
    threads: int | str = "auto"
    """``"auto"``, ``"keep"``, or a number of threads per rank."""
    fused: str = "auto"
    """``"auto"`` (numba's kernels when it is installed), ``"0"`` (NumPy) or ``"1"`` (numba's)."""
    persistent: str = "auto"
    """MPI-4 persistent collectives: ``"auto"`` (where supported), ``"0"`` (never) or ``"1"``."""


def positive_seconds(value: object, name: str) -> float:
    """`value` as a finite number of seconds > 0, else a ``TypeError``/``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__} "
                        f"{value!r}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    return float(value)


def _text(name: str) -> str | None:
    text = os.environ.get(name, "").strip()
    return text or None


def _seconds(name: str, default: float, zero: bool = False) -> float:
    """A positive number of seconds (or 0 too, if `zero`: "off")."""
    text = _text(name)
    if text is None:
        return default
    try:
        return 0.0 if zero and float(text) == 0 else positive_seconds(float(text), name)
    except ValueError:
        kind = "number of seconds >= 0" if zero else "positive number of seconds"
        raise ValueError(f"{name} must be a {kind}, got {text!r}") from None


def _flag(name: str, default: bool) -> bool:
    text = _text(name)
    if text is None:
        return default
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(f"{name} must be one of {'/'.join(_TRUE)} or {'/'.join(_FALSE)}, "
                     f"got {text!r}")


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    text = _text(name)
    if text is None:
        return default
    if text.lower() not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {text!r}")
    return text.lower()


def threads_setting(text: str | None) -> int | str:
    """``TENSORPLAY_MPI_THREADS``: ``"auto"`` when unset, ``"keep"``, or a positive integer."""
    text = (text or "").strip().lower()
    if not text:
        return "auto"
    if text == "keep":
        return text
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"TENSORPLAY_MPI_THREADS must be keep or a positive integer, got "
                         f"{text!r}")
    return int(text)


@lru_cache(maxsize=1)
def settings() -> Settings:
    """The settings of this process, read from the environment on the first call.

    Cached: tests that change the environment call
    :func:`tensorplay_mpi.testing.reset_settings` afterwards.

    Raises
    ------
    ValueError
        If a variable holds a value it does not accept.
    """
    _warn_unknown_names()
    return Settings(
        timeout=_seconds("TENSORPLAY_MPI_TIMEOUT", Settings.timeout),
        stall=_seconds("TENSORPLAY_MPI_STALL", Settings.stall, zero=True),
        grace=_seconds("TENSORPLAY_MPI_GRACE", Settings.grace),
        debug=_flag("TENSORPLAY_MPI_DEBUG", Settings.debug),
        cuda_aware=_choice("TENSORPLAY_MPI_CUDA_AWARE", Settings.cuda_aware, ("auto", "0", "1")),
        excepthook=_flag("TENSORPLAY_MPI_EXCEPTHOOK", Settings.excepthook),
        threads=threads_setting(os.environ.get("TENSORPLAY_MPI_THREADS")),
        fused=_choice("TENSORPLAY_MPI_FUSED", Settings.fused, ("auto", "0", "1")),
        persistent=_choice("TENSORPLAY_MPI_PERSISTENT", Settings.persistent, ("auto", "0", "1")),
    )


_warned: set[str] = set()  # unknown names already warned about
register(settings.cache_clear, "settings")
register(_warned.clear, "settings")


def _warn_unknown_names() -> None:
    """One RuntimeWarning on rank 0 for ``TENSORPLAY_MPI_*`` names that are no setting."""
    known = {_PREFIX + field.name.upper() for field in fields(Settings)}
    unknown = sorted(name for name in os.environ
                     if name.startswith(_PREFIX) and name not in known | _warned)
    if not unknown:
        return
    _warned.update(unknown)
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() != 0:
        return
    for name in unknown:
        close = difflib.get_close_matches(name[len(_PREFIX):],
                                          [k[len(_PREFIX):] for k in sorted(known)], n=1)
        hint = (f"did you mean {_PREFIX}{close[0]}?" if close
                else f"the settings are {', '.join(sorted(known))}")
        warnings.warn(f"{name} is not a tensorplay_mpi setting and is ignored ({hint})",
                      RuntimeWarning, stacklevel=2)
