"""The exceptions tensorplay_mpi raises when a collective cannot complete as issued."""

__all__ = ["CollectiveTimeoutError", "PeerFailureError", "CollectiveMismatchError"]


class CollectiveTimeoutError(TimeoutError):
    """A library wait passed its deadline; the communicator is then aborted."""


class PeerFailureError(RuntimeError):
    """Another rank left a Join or a step through an exception while this rank waited."""


class CollectiveMismatchError(RuntimeError):
    """Ranks were about to issue different collectives (``TENSORPLAY_MPI_DEBUG=1``)."""
