"""The contract a joinable implements: :class:`JoinHook`, :class:`Joinable` and, to go on
without lost ranks, :class:`ElasticJoinable` (the names of ``torch.distributed.algorithms.join``;
the Join that drives them is :mod:`tensorplay_mpi.algorithms.join`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from mpi4py import MPI

if TYPE_CHECKING:
    from .join import Join


class JoinHook:
    """What a joinable does on a rank that has run out of inputs.

    Both methods are no-ops; override the ones you need.
    """

    def main_hook(self) -> None:
        """Shadow exactly the collectives of one active iteration (called once per round)."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """Finish up once every rank has joined.

        Parameters
        ----------
        is_last_joiner : bool
            True iff no rank was still active when this rank joined (ties allowed).
        """


class Joinable(ABC):
    """Something that issues collectives per iteration and can shadow them once joined.

    Subclasses must call ``Joinable.__init__`` (``super().__init__()``) and implement
    :meth:`join_hook`, :attr:`join_device` and :attr:`join_process_group`.  Each iteration
    should start with ``Join.notify_join_context(self)``.  :attr:`join_context` is the Join
    the joinable is bound to; :meth:`end_iteration` may be overridden.
    """

    _orders_blocks = False
    """True for a joinable whose announcements order every collective of an iteration while
    ranks have joined (:class:`~tensorplay_mpi.JoinableComm`): at most one per Join."""
    _announces_blocks = False
    """True for a joinable whose iteration is one block of collectives that it announces in
    a Join with an ordering joinable (see :meth:`Join.announce`); its hook then runs where
    the announcement is, not in list order (DataParallel, the library's optimizers)."""

    @abstractmethod
    def __init__(self) -> None:
        super().__init__()
        self._bound_join: Join | None = None
        self._made_join: Join | None = None  # the latest Join made with it, until entered

    @abstractmethod
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Return the hook that shadows this joinable; gets every kwarg given to :class:`Join`."""

    @property
    @abstractmethod
    def join_device(self) -> str:
        """Device of this joinable's data: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""

    @property
    @abstractmethod
    def join_process_group(self) -> MPI.Intracomm:
        """The communicator this joinable's collectives run on."""

    @property
    def join_context(self) -> "Join | None":
        """The entered Join this joinable is bound to, else ``None``.

        Its public state (:attr:`Join.enabled`, :attr:`Join.joinables`, :attr:`Join.joined`,
        :meth:`Join.active_ranks`) is what a joinable may read about its Join.
        """
        return _bound_join(self)

    def _set_join_context(self, join: "Join | None") -> None:
        """Bind this joinable to `join` from its ``__enter__`` to its ``__exit__`` (``None``):
        the only writer of :attr:`join_context`."""
        self._bound_join = join
        if join is not None:
            self._made_join = None  # entered: not a forgotten Join

    def _made_into(self, join: "Join") -> None:
        """`join` was made with this joinable: until it is entered, it may be forgotten."""
        self._made_join = join

    def _brought_joinables(self, listed: "list[Joinable]") -> "list[Joinable]":
        """Joinables of its own that a Join made of `listed` (this one among them) holds too,
        after the listed ones: DataParallel's JoinableComm for the SyncBatchNorm layers over
        its parameters that have no group.  The default is none."""
        return []

    def replicated_arrays(self) -> "list[Any]":
        """Arrays that must be identical on every rank (parameters, replicated optimizer state).

        After a failure every rank caught at the same point, the next Join on the communicator
        compares a digest of them across ranks (the replica check).  The default
        is none.
        """
        return []

    def end_iteration(self) -> None:
        """Close the current iteration; the Join calls it before each heartbeat and once
        before this rank starts shadowing, for every joinable in list order.

        A joinable whose iterations end with a message to joined ranks (JoinableComm sends an
        END announcement) sends it here.  The default does nothing.
        """

    def defers_requests(self) -> bool:
        """Whether a stop or a periodic save must wait for a later iteration boundary: this
        joinable holds state that a later iteration completes (DataParallel: gradients
        accumulated under ``no_sync()`` and not yet averaged).  It must be the same on every
        rank at each boundary, joined ranks included.  The default is False."""
        return False

    def start_ready(self) -> None:
        """Start, now, the collectives this joinable holds ready to start (DataParallel's
        buckets whose gradients are final): another joinable of the Join is about to issue
        one, and the order of an iteration's collectives must not depend on timing.  The
        default does nothing.
        """


class ElasticJoinable(Joinable):
    """A joinable that goes on without lost ranks in a ``Join(..., elastic=True)``.

    Under an MPI with fault tolerance (ULFM), when ranks are lost every survivor shrinks the
    Join's communicator to the survivors, then settles the interrupted iteration: the
    survivors agree on the most updates any of them applied (:meth:`elastic_progress`, the
    highest over the Join's joinables) and on the lowest rank that applied them; every
    survivor copies that rank's arrays (:meth:`elastic_state`, in place) and calls
    :meth:`elastic_restore`; the objects outside the Join that the steps advance
    (:meth:`elastic_companions`) load that rank's ``state_dict()``; finally every joinable
    :meth:`move_to` the survivors' communicator, and the Join raises
    :class:`~tensorplay_mpi.errors.RanksLostError`.

    A joinable whose state every rank holds alike (replicated) implements this; one whose
    state dies with a rank (a sharded optimizer's shards) must not, and a Join with it refuses
    ``elastic=True``.  Subclasses call ``super().__init__()`` and implement :meth:`move_to`;
    the other methods default to "no state, no step".
    """

    needs_step_owner = False
    """True for a joinable whose state changes through another one that applies the step
    (DataParallel's parameters, through an optimizer in the Join or ``update=``): an elastic
    Join then needs a joinable whose :meth:`elastic_progress` is not ``None``."""

    def elastic_progress(self) -> int | None:
        """The updates this joinable applied on this rank (steps it owns), or ``None`` when it
        owns no step (the default).  Survivors are at most one update apart."""
        return None

    def elastic_state(self) -> list[Any]:
        """The arrays that make this joinable's replicated state (parameters, optimizer state,
        counters in arrays of their own), the same shapes and dtypes on every rank, in the same
        order: a survivor behind receives the settled survivor's values into them, in place.
        The default is none."""
        return []

    def elastic_restore(self) -> None:
        """Read the state back after the arrays of :meth:`elastic_state` were written (counters
        into attributes).  The default does nothing."""

    def elastic_companions(self) -> list[Any]:
        """Objects outside the Join whose state this joinable's steps advance (DataParallel's
        ``update=`` optimizer), each with ``state_dict()`` and ``load_state_dict()``: the
        settled survivor's ``state_dict()`` is loaded on the others.  The default is none."""
        return []

    @abstractmethod
    def move_to(self, comm: MPI.Intracomm) -> None:
        """Work on `comm` from now on: the survivors' communicator after a lost rank.

        Collective over `comm`: every survivor calls it, for the same joinables in the same
        order.
        """


def _bound_join(joinable: Joinable) -> "Join | None":
    try:
        return joinable._bound_join
    except AttributeError:
        name = type(joinable).__name__
        raise TypeError(
            f"{name} does not call the Joinable constructor: add super().__init__() "
            f"(or Joinable.__init__(self)) to {name}.__init__"
        ) from None


def _check_not_forgotten(joinable: Joinable) -> None:
    """Raise if a Join was made with `joinable` and never entered: its iterations would run
    without the protocol (uneven inputs hang), silently."""
    made = joinable._made_join
    if made is not None and made._enable:
        joinable._made_join = None  # said once
        name = type(joinable).__name__
        raise RuntimeError(
            f"a Join was made with this {name} but never entered, so its iterations run "
            f"outside any Join: use the Join as a context manager, `with Join([...]):` "
            f"(a bare Join(...) or dp.join() call does nothing)")
