"""Every ``TENSORPLAY_MPI_*`` environment variable, parsed once and validated in one place.

==============================  =======================================  =========
variable                        meaning                                  default
==============================  =======================================  =========
``TENSORPLAY_MPI_TIMEOUT``      seconds a library wait may take          ``1800``
``TENSORPLAY_MPI_GRACE``        seconds the failure agreement may take   ``10``
``TENSORPLAY_MPI_DEBUG``        collective signature checks              ``0``
``TENSORPLAY_MPI_CUDA_AWARE``   device pointers to MPI: auto, 0 or 1     ``auto``
``TENSORPLAY_MPI_EXCEPTHOOK``   abort the job on an uncaught exception   ``1``
``TENSORPLAY_MPI_THREADS``      BLAS threads per rank: keep or a number  automatic
``TENSORPLAY_MPI_FUSED``        fused optimizer steps: auto, 0 or 1      ``auto``
==============================  =======================================  =========

Booleans accept ``1/true/yes/on`` and ``0/false/no/off`` (any case).  A value that is none of
the accepted ones raises ``ValueError`` naming the variable, at the first library call that
needs the settings.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["Settings", "settings", "positive_seconds", "threads_setting"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Settings:
    """The library's settings, read from the environment by :func:`settings`."""

    timeout: float = 1800.0
    grace: float = 10.0
    debug: bool = False
    cuda_aware: str = "auto"
    excepthook: bool = True
    threads: int | str = "auto"
    """``"auto"``, ``"keep"``, or a number of threads per rank."""
    fused: str = "auto"
    """``"auto"`` (numba's kernels when it is installed), ``"0"`` (NumPy) or ``"1"`` (numba's)."""


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


def _seconds(name: str, default: float) -> float:
    text = _text(name)
    if text is None:
        return default
    try:
        return positive_seconds(float(text), name)
    except ValueError:
        raise ValueError(f"{name} must be a positive number of seconds, got {text!r}") from None


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

    Tests that change the environment call ``settings.cache_clear()`` afterwards.

    Raises
    ------
    ValueError
        If a variable holds a value it does not accept.
    """
    return Settings(
        timeout=_seconds("TENSORPLAY_MPI_TIMEOUT", Settings.timeout),
        grace=_seconds("TENSORPLAY_MPI_GRACE", Settings.grace),
        debug=_flag("TENSORPLAY_MPI_DEBUG", Settings.debug),
        cuda_aware=_choice("TENSORPLAY_MPI_CUDA_AWARE", Settings.cuda_aware, ("auto", "0", "1")),
        excepthook=_flag("TENSORPLAY_MPI_EXCEPTHOOK", Settings.excepthook),
        threads=threads_setting(os.environ.get("TENSORPLAY_MPI_THREADS")),
        fused=_choice("TENSORPLAY_MPI_FUSED", Settings.fused, ("auto", "0", "1")),
    )
