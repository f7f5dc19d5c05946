"""Stop and save requests inside a Join: plain state, bits in and decisions out.

A rank's requests are flags (:mod:`tensorplay_mpi.stopping`: a signal or a call sets them).  A
Join holds one :class:`Requests`, which puts them into the bits of its heartbeats and polls,
reads what every rank asked from their sums, and tells the Join when a save is due; the Join
runs ``on_save`` itself.  Every rank's save request is withdrawn in one place, as the save
starts (:meth:`Requests.start_save`: it serves every request made before it).  A request
that no ``on_save`` served (a Join without one, or one that stopped first, where
``join.save_due`` tells the caller) stays pending for the next Join's ``on_save``, or until
:func:`~tensorplay_mpi.stopping.clear_save`.

A heartbeat or poll is one int64: bits 0-23 count the active ranks, bits 24-43 the ranks that
ask to stop, bits 44-62 those that ask for a save; so a rank with a pending stop request sends
``1 + 2**24`` in a heartbeat and ``2**24`` in a poll.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..stopping import clear_save, request_save, save_requested, stop_requested

_ACTIVE_BITS, _STOP_BITS = 24, 20  # the fields: active count, stops, saves
STOP = 1 << _ACTIVE_BITS
"""What a stop request adds to a heartbeat or poll (bits 24-43 count the requests)."""
SAVE = 1 << (_ACTIVE_BITS + _STOP_BITS)
"""What a save request adds to a heartbeat or poll (bits 44-62 count the requests)."""


def _constant(value: int) -> np.ndarray:
    array = np.full(1, value, dtype=np.int64)
    array.flags.writeable = False  # shared read-only send buffer of every heartbeat
    return array


# the heartbeat by (a stop is requested, a save is requested)
_HEARTBEAT = {(stop, save): _constant(1 + stop * STOP + save * SAVE)
              for stop in (False, True) for save in (False, True)}

class Requests:
    """The stop and save requests of one Join, as its heartbeats and polls carry them.

    Parameters
    ----------
    deferring : callable
        Whether a joinable asks requests to wait now (gradients accumulated under
        ``no_sync()``): a stop or save then lands at the next boundary where none does.
    """

    def __init__(self, deferring: Callable[[], bool]):
        self._deferring = deferring
        self.stops = 0  # the most ranks any completed heartbeat or poll said asked to stop
        self.asked: str | None = None  # this rank's stop request, once a heartbeat sent it
        self._save_due = False  # a completed heartbeat or poll carried a save request

    # -- what this rank sends ---------------------------------------------------------------

    def heartbeat(self) -> np.ndarray:
        """The send buffer of this rank's next heartbeat: one active rank, and its requests."""
        return _HEARTBEAT[self._asks_to_stop(), self._asks_to_save()]

    def poll(self) -> int:
        """The value of this rank's next poll once joined: its requests only."""
        return STOP * self._asks_to_stop() + SAVE * self._asks_to_save()

    def _asks_to_stop(self) -> bool:
        self.asked = self.asked or stop_requested()
        return self.asked is not None

    @staticmethod
    def _asks_to_save() -> bool:
        return save_requested() is not None  # once carried, save_due holds it until served

    # -- what every rank asked ----------------------------------------------------------------

    def read(self, buf: np.ndarray) -> int:
        """The number of active ranks in a heartbeat's or poll's sum; notes the requests."""
        total = int(buf[0])
        self.stops = max(self.stops, (total >> _ACTIVE_BITS) & (SAVE // STOP - 1))
        self._save_due = self._save_due or total >= SAVE
        return total & (STOP - 1)

    @property
    def stopped(self) -> bool:
        """Whether a heartbeat or poll read so far carried a stop request, unless deferred."""
        return self.stops > 0 and not self._deferring()

    @property
    def stop_reason(self) -> str:
        """Why the Join stopped, once :attr:`stopped`: this rank's own reason, or how many
        other ranks asked."""
        return self.asked or f"a stop requested by {self.stops} other rank(s)"

    @property
    def save_due(self) -> bool:
        """Whether a save request was carried and ``on_save`` has not run for it (unless
        deferred)."""
        return self._save_due and not self._deferring()

    # -- the save ---------------------------------------------------------------------------

    @property
    def save_now(self) -> bool:
        """Whether a Join with ``on_save`` runs it at this boundary: a save is due and no stop
        was carried (a stop's own save follows); every rank decides on the same heartbeats,
        so at the same boundary."""
        return self.stops == 0 and self.save_due

    def start_save(self) -> str | None:
        """Note that ``on_save`` starts: the one place a save request is withdrawn, on every
        rank, for the save serves every request made before it (a request made during
        ``on_save`` asks for the next one).  Returns the withdrawn request's reason, for
        :meth:`unserved`."""
        self._save_due = False
        reason = save_requested()
        clear_save()
        return reason

    @staticmethod
    def unserved(reason: str | None) -> None:
        """``on_save`` failed: make this rank's withdrawn request (`reason`, from
        :meth:`start_save`) pending again, as before the save, unless a newer one is."""
        if reason is not None and save_requested() is None:
            request_save(reason)
