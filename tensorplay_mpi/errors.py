"""The exceptions tensorplay_mpi raises when a collective cannot complete as issued."""

from typing import Any

__all__ = ["CollectiveTimeoutError", "PeerFailureError", "CollectiveMismatchError",
           "EarlyTerminationError", "RanksLostError"]


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


class RanksLostError(PeerFailureError):
    """Ranks were lost and the Join went on without them (``Join(..., elastic=True)`` under an
    MPI with fault tolerance): raised on every survivor, once the interrupted iteration is
    settled and every joinable of the Join works on :attr:`comm`.

    Catch it around the Join and make a new Join with the same joinables: the loop goes on
    from :attr:`step` (``Sampler.shrink`` re-splits the epoch's unused samples).

    Attributes
    ----------
    lost : list of int
        The lost ranks, numbered in the old communicator.
    comm : mpi4py.MPI.Intracomm
        The survivors' communicator (``MPI_Comm_shrink`` of the old one).
    rank, size : int
        This rank in :attr:`comm`, and the number of survivors.
    old_rank, old_size : int
        This rank and the size in the old communicator.
    step : int
        Updates applied on every survivor after the settle (the step owners' count:
        ``dp.steps``, ``opt.steps``); the same on every survivor.
    steps : int
        Updates applied within the interrupted Join: a sampler's batches consumed by each
        rank that was still active (``Sampler.shrink(lost, steps)``).
    completed : bool
        Whether this rank received the interrupted step's result from a survivor that had
        finished it (its batch of that step counts as used), rather than computed it.

    Only the Join's joinables moved; :meth:`move` moves others (a DataParallel and its
    optimizer after a loss in a validation ``Join([jc], elastic=True)``).
    """

    def __init__(self, message: str, *, lost: list[int], comm: Any, old_rank: int,
                 old_size: int, step: int, steps: int, completed: bool) -> None:
        super().__init__(message)
        self.lost, self.comm, self.step, self.steps = lost, comm, step, steps
        self.old_rank, self.old_size, self.completed = old_rank, old_size, completed
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def move(self, *joinables: Any) -> None:
        """Move `joinables`, which were not in the Join that lost the ranks, onto :attr:`comm`.

        Collective over :attr:`comm`: every survivor moves the same ones, in the same order.
        Their state is not settled: move only joinables that no interrupted step changed
        (those of the training loop, after a loss in a validation Join).
        """
        for joinable in joinables:
            joinable.move_to(self.comm)
