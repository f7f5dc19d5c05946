"""The stream a DataParallel brings into its Joins for layers that reduce through a Join's
JoinableComm without a group of their own (SyncBatchNorm converted as torch users write it,
``SyncBatchNorm.convert_sync_batchnorm(model)``).

Such a layer tags its parameters and buffers with a link (the attribute
:data:`~tensorplay_mpi.algorithms.join.JOIN_CHECK`): a callable that checks a Join made with
the DataParallel over them, and ``needs_stream``, true while the layer has no group.  When the
DataParallel's tensors carry such links it holds a :class:`~tensorplay_mpi.JoinableComm` on its
communicator, made in its constructor (every rank agrees first that one is needed), and a Join
made with it and without a JoinableComm of the caller's holds that one too, after the listed
joinables: ``Join([dp])`` is then ``Join([dp, jc])``, ``Join([dp, opt])`` is ``Join([dp, opt,
jc])``.  The layers reduce through the JoinableComm of the running Join, so a joined rank
shadows their statistics in the one ordered stream of the active ranks' operations.
"""

from __future__ import annotations

from typing import Any, Sequence

from mpi4py import MPI

from ..algorithms._joinable_comm import JoinableComm
from ..algorithms.join import JOIN_CHECK, Join, Joinable


class LayerLinks:
    """The links of the layers over a DataParallel's tensors, and the stream it holds for them.

    Parameters
    ----------
    tensors : sequence
        The caller's parameters and buffers (arrays carry no link).
    """

    def __init__(self, tensors: Sequence[Any]) -> None:
        links = (getattr(t, JOIN_CHECK, None) for t in tensors)
        self._links = list({id(link): link for link in links if link is not None}.values())
        self.stream: JoinableComm | None = None

    @property
    def streamless(self) -> int:
        """How many of the layers have no group now (they need a Join's JoinableComm)."""
        return sum(bool(link.needs_stream) for link in self._links)

    def make_stream(self, comm: MPI.Intracomm, timeout: float | None) -> None:
        """Make the JoinableComm on `comm` if a layer needs one.  Collective over `comm`: every
        rank has the same :attr:`streamless` (the DataParallel's argument check)."""
        if self.streamless:
            self.stream = JoinableComm(comm, timeout)

    def brought(self, listed: Sequence[Joinable]) -> list[Joinable]:
        """The stream, for a Join of the `listed` joinables without a JoinableComm, while a
        layer has no group; else nothing."""
        if self.stream is None or not self.streamless or any(
                isinstance(joinable, JoinableComm) for joinable in listed):
            return []
        return [self.stream]

    def check(self, join: Join) -> None:
        """Every layer's check of `join` (``ValueError`` on every rank if one cannot train in
        it)."""
        for link in self._links:
            link(join)
