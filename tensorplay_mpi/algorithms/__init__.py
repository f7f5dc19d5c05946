"""Distributed algorithms: the Join context manager for uneven inputs and the joinables built
on it alone.

``Join``, ``Joinable`` and ``JoinHook`` are the protocol (:mod:`tensorplay_mpi.algorithms.join`,
the path of ``torch.distributed.algorithms.join``); ``ElasticJoinable`` is what a joinable
implements to go on without lost ranks in ``Join(..., elastic=True)``; ``JoinableComm`` wraps a
communicator whose collectives a joined rank shadows by itself; ``GuardedJoinable`` is the base
of the library's joinables (a communicator, a deadline for every wait, the failure guard) for
your own; ``recover`` goes on without a lost rank that surfaced outside an elastic Join; and
``SparePool`` keeps hot spares that take a lost rank's place.
"""

from ._elastic import recover
from ._guarded_joinable import GuardedJoinable
from ._joinable_comm import JoinableComm
from ._spares import SparePool
from .join import ElasticJoinable, Join, Joinable, JoinHook

__all__ = ["Join", "Joinable", "JoinHook", "ElasticJoinable", "JoinableComm", "GuardedJoinable",
           "recover", "SparePool"]
