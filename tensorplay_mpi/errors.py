"""The exceptions tensorplay_mpi raises when a collective cannot complete as issued."""

__all__ = ["CollectiveTimeoutError", "PeerFailureError", "CollectiveMismatchError",
           "EarlyTerminationError"]


class CollectiveTimeoutError(TimeoutError):
    """A library wait passed its deadline; the communicator is then aborted."""


class PeerFailureError(RuntimeError):
    """Another rank left a Join or a step through an exception while this rank waited."""


class CollectiveMismatchError(RuntimeError):
    """Ranks were about to issue different collectives (``TENSORPLAY_MPI_DEBUG=1``)."""


class EarlyTerminationError(RuntimeError):
    """Throw mode (``Join(..., throw_on_early_termination=True)``): some rank ran out of inputs.

    A subclass of ``RuntimeError``, so code written for PyTorch's Join still catches it.
    """
