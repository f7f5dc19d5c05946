"""The resets of the library's process-wide state, registered by the modules that hold it.

A module whose state a test may need to reset (a decision cached from the environment, this
rank's requests, a hook it installed) registers the function that resets it, once, when it is
imported: ``register(settings.cache_clear, "settings")``.  :func:`reset_all` calls those of the
scopes asked for; ``tensorplay_mpi.testing`` resets through it.  A module that was never
imported holds no state, so nothing is missed, and no list elsewhere has to name the modules.
docs/api/index.md lists every piece of process-wide state; tests/project/test_api_index.py holds
that table against this registry and the modules' sources.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Iterable, NamedTuple

SCOPES = ("settings", "requests", "process")
"""Who resets a piece of state: ``"settings"`` (decided from the environment: a test that
changes the environment resets these), ``"requests"`` (this rank's stop and save requests:
reset around every test, with the settings) or ``"process"`` (the process's set-up)."""


class Reset(NamedTuple):
    """One registered reset."""

    reset: Callable[[], Any]
    """Resets the state (no arguments)."""
    scope: str
    """One of :data:`SCOPES`."""
    module: str
    """The module that registered it (``tensorplay_mpi.settings``)."""
    name: str
    """Its name in that module, as the state table writes it (``settings.cache_clear``)."""


_registered: list[Reset] = []  # in registration (import) order


def register(reset: Callable[[], Any], scope: str = "process") -> None:
    """Register `reset`, which resets a piece of the calling module's state, under `scope`
    (one of :data:`SCOPES`); call it at the module's top level."""
    if scope not in SCOPES:
        raise ValueError(f"unknown scope {scope!r}: the scopes are {', '.join(SCOPES)}")
    caller = sys._getframe(1).f_globals
    _registered.append(Reset(reset, scope, caller["__name__"], _name(reset, caller)))


def _name(reset: Callable[[], Any], namespace: dict[str, Any]) -> str:
    """``owner.method`` for a method of a cached function or of a module-level object
    (``settings.cache_clear``, ``_warned.clear``), else the function's own name."""
    owner = getattr(reset, "__self__", None)
    if owner is None or isinstance(owner, type(sys)):
        return reset.__qualname__
    owner_name = next((key for key, value in namespace.items() if value is owner),
                      getattr(owner, "__name__", type(owner).__name__))
    return f"{owner_name}.{reset.__name__}"


def registered() -> tuple[Reset, ...]:
    """Every reset registered so far, in registration order."""
    return tuple(_registered)


def reset_all(scopes: str | Iterable[str] = SCOPES) -> None:
    """Call every registered reset of `scopes` (one name or several; all by default).

    Raises
    ------
    ValueError
        For an unknown scope (before anything is reset).
    """
    scopes = {scopes} if isinstance(scopes, str) else set(scopes)
    unknown = scopes - set(SCOPES)
    if unknown:
        raise ValueError(f"unknown scope(s) {sorted(unknown)}: the scopes are "
                         f"{', '.join(SCOPES)}")
    for entry in _registered:
        if entry.scope in scopes:
            entry.reset()
