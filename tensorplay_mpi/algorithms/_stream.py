"""The ordered stream of a Join: while ranks have joined, the order in which a joined rank runs
the hooks of the joinables that announce their blocks.

A Join with an ordering joinable (one with ``_orders_blocks`` that implements
:class:`BlockOrderer`: the :class:`~tensorplay_mpi.JoinableComm`) owns one
:class:`BlockStream`.  An active rank announces a block through it
(:meth:`BlockStream.announce`: DataParallel's step, an optimizer's); a joined rank, following
the orderer's announcements, runs the main hook of the joinable an announcement names
(:meth:`BlockStream.shadow`), between the other operations the active ranks issue, instead of in
list order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    from .join import Join, Joinable, JoinHook


@runtime_checkable
class BlockOrderer(Protocol):
    """A joinable whose announcements order a Join's other blocks while ranks have joined."""

    def announce_block(self, index: int) -> None:
        """Announce joinable `index`'s block of collectives: a joined rank following the
        announcements calls :meth:`BlockStream.shadow` with `index` there."""


class BlockStream:
    """The blocks of a Join's announcing joinables, in the order the active ranks issue them.

    Parameters
    ----------
    orderer : BlockOrderer
        The joinable whose announcements carry the blocks (one of `joinables`).
    joinables, hooks : sequence
        The Join's joinables and their hooks, in list order.
    rank : int
        This rank, for the errors.
    """

    def __init__(self, orderer: BlockOrderer, joinables: Sequence[Joinable],
                 hooks: Sequence[JoinHook], rank: int) -> None:
        self._orderer = orderer
        self._joinables, self._hooks = list(joinables), list(hooks)
        self._index = {id(joinable): i for i, joinable in enumerate(self._joinables)}
        self._rank = rank

    @staticmethod
    def of(join: Join | None) -> BlockStream:
        """The stream of `join` (a joinable's :attr:`~Joinable.join_context`); raises
        RuntimeError when there is none (no Join, or one without an ordering joinable)."""
        stream = join.stream if join is not None else None
        if stream is None:
            raise RuntimeError("an announced block outside a Join with an ordering joinable "
                               "(a JoinableComm)")
        return stream

    @property
    def orderer(self) -> BlockOrderer:
        """The joinable whose announcements order the blocks (the Join's JoinableComm)."""
        return self._orderer

    def follows(self, joinable: Joinable) -> bool:
        """Whether a joined rank runs `joinable`'s main hook where the stream names it (a
        joinable with ``_announces_blocks`` other than the orderer), not in list order."""
        return joinable is not self._orderer and joinable._announces_blocks

    def announce(self, joinable: Joinable) -> None:
        """Announce that `joinable`'s block of collectives starts now (an active rank, while
        ranks have joined).  Collective over the orderer's communicator."""
        self._orderer.announce_block(self._index[id(joinable)])

    def shadow(self, index: int) -> None:
        """A joined rank's side of an announced block: the main hook of joinable `index`.

        Raises
        ------
        RuntimeError
            If joinable `index` announces no block in this Join.
        """
        if not 0 <= index < len(self._joinables) or not self.follows(self._joinables[index]):
            raise RuntimeError(f"rank {self._rank}: an announced block names joinable {index}, "
                               "which announces none in this Join")
        self._hooks[index].main_hook()
