"""JoinableComm: any iterative MPI loop made join-safe without writing a hook.

Wire schedule.  Every operation starts with an announcement, ``Iallreduce(int64[42], MAX)``
of ``[kind, op, dtype, root, count, variant or row digest, digest, -digest, rank == root,
rank, payload[32]]``; joined ranks send the int64 minimum, so every rank learns the operation,
the highest active rank and whether an int root is active.  ``digest`` hashes the fields
before it: every rank checks ``max(digest) == -max(-digest)`` (all active ranks announced
the same operation) and the digest itself (it is an announcement, not another joinable's
collective), and raises :class:`~tensorplay_mpi.errors.CollectiveMismatchError` if not, before
any data moves: a call whose kind, dtype, element count, op or root differs between ranks
never returns a value, whether or not ranks have joined, inside a Join or outside.

Small operations travel in the announcement itself (one collective, not two): a MAX, MIN,
LAND or LOR allreduce of up to 32 host values, as int64 keys in the order of the values (the
int64 minimum is MAX's identity), a float SUM whose values fit once per rank (each rank's in
its own slots, summed by every rank in rank order: ``SLOT_SUM``), and a broadcast of up to 256
bytes whose root is known (an int, the last rank while every rank is active, or the highest
active rank learnt from an earlier announcement with the same count of active ranks: in one
Join, the same count is the same ranks), only the root writing its bytes.  Other operations
follow their announcement:

- every rank active (the heartbeat's count ``n == size``, read after the first announcement
  so that the two overlap), and outside an enabled Join: ``allreduce`` and ``bcast`` of a host
  array of at most :data:`~tensorplay_mpi.comm._persistent.MAX_BYTES` bytes through a persistent
  collective, else one ``Iallreduce`` / ``Ibcast``; ``allgather`` an ``Iallgather`` of
  ``[row count, digest of dtype and trailing shape]``, then an ``Iallgatherv``;
- ``n < size``: the same nonblocking collectives, joined ranks contributing the identity of
  the op, zero rows, or only receiving.  The iteration ends with an announcement of kind END,
  sent before the next heartbeat or when the rank joins.  A joined rank's hook follows the
  announcements until END, so it needs no recording of the past: a rank with zero
  iterations, or a loop whose collectives change, works;
- ``n == 1`` read in this iteration or an earlier one of the Join (the count never grows): no
  collective at all, the result being the input with the joined ranks' identities, but for a
  result a kept array receives in an elastic Join or one with other joinables, announced as
  ``ALONE`` (in the payload, or followed by an ``Ibcast`` from this rank); in ``Join([jc])``
  the kept arrays are sent whole
  (``CATCH_UP``) where joined ranks read them: before ``on_save``, before a refusal, and in the
  hook's ``post_hook``.

Arguments are checked on every rank before any collective, the same way in both modes.  Inputs
in any layout are sent in C order (copied when they are not C-contiguous); an ``out`` that is
not C-contiguous is refused (``ValueError``).
"""

from __future__ import annotations

import math
from typing import Any, NoReturn, TypeGuard

import numpy as np
from mpi4py import MPI

from ..comm._agreement import KINDS, agree_on_setting, kind_code
from ..comm._buffers import device_of, is_device_array, misordered, zeros_like
from ..comm._collectives import Work, iallgather, iallgatherv, iallreduce, ibcast
from ..comm._digests import ints_digest
from ..comm._ops import OPS
from ..comm import _torch_cuda as torch_cuda
from ..comm._persistent import MAX_BYTES, SPINS, PersistentCollectives, enabled
from ..comm._tensors import as_array, is_tensor, like
from ..errors import CollectiveMismatchError
from .._threads import oversubscribed
from . import _announcements as wire
from ._guarded_joinable import GuardedJoinable
from ._kept import ACCUMULATE, OUT, KeptArrays
from .join import ElasticJoinable, Join, JoinHook
from ._stream import BlockStream

_LOGICAL = {OPS.index(name) + 1 for name in ("LAND", "LOR", "LXOR")}
"""The op codes whose result over one rank's integers is 0 or 1, not the integers."""


def _fits_persistent(x: Any) -> bool:
    """Whether `x` (as :meth:`JoinableComm._array` gives it) takes a persistent collective while
    every rank is active: a host array of at most :data:`~tensorplay_mpi.comm._persistent.MAX_BYTES`
    bytes."""
    return type(x) is np.ndarray and x.nbytes <= MAX_BYTES


def _completed(value: Any, what: str) -> Work:
    """A Work already complete, whose result is `value` (an operation done by its announcement)."""
    work = Work(MPI.REQUEST_NULL, what, value=value)
    work.is_completed()
    return work


class JoinableComm(GuardedJoinable, ElasticJoinable):
    """A Joinable wrapping a communicator: its collectives are shadowed automatically.

    Results on active ranks are exactly what they would be if the joined ranks did not exist.
    Collective over `comm`: every active rank calls :meth:`begin_iteration` once per iteration,
    then the same operations in the same order.  After a first joinable that leads the
    iterations (``Join([dp, jc])``, ``Join([dp, opt, jc])``), its heartbeat starts the
    iteration and :meth:`begin_iteration` is not needed: operations may run anywhere in the
    iteration, inside ``dp.step()`` too (SyncBatchNorm's statistics in the forward and backward
    passes); while ranks have joined, the other joinables announce their blocks through this
    JoinableComm (:meth:`Join.announce`), so a joined rank follows one ordered stream.
    Outside an enabled Join the operations are plain collectives over every rank and nothing
    is retained.
    Operations take NumPy or CuPy arrays, torch tensors (CPU or CUDA) and CPU DLPack exporters
    (without copies); a new result is a torch tensor on the input's device when it is one.

    Parameters
    ----------
    comm, timeout
        As for :class:`~tensorplay_mpi.algorithms.GuardedJoinable`.

    Examples
    --------
    ::

        jc = JoinableComm(comm)
        with Join([jc]):                      # or Join([dp, jc])
            for chunk in my_chunks:
                jc.begin_iteration()
                total = jc.allreduce(chunk.sum(axis=0))
                rows = jc.allgather(chunk[:2])
                w = jc.bcast(weights, root="highest_active")
    """

    _orders_blocks = True  # its announcements order a Join's other blocks (Join.announce)
    _counts_own_results = True  # its elastic progress counts kept results, not model steps

    def __init__(self, comm: MPI.Intracomm | None = None, timeout: float | None = None) -> None:
        super().__init__(comm, timeout)  # device: of the last array seen (joined ranks: host)
        self._announcement = np.empty(wire.SLOTS, np.int64)
        self._rows: dict = {}  # this rank's announcement rows, by signature (wire.encode)
        self._row_header = np.empty(2, np.int64)  # [row count, row digest] of an allgather
        self._row_headers = np.empty((self.size, 2), np.int64)
        self._owner: Join | None = None  # the enabled Join of the current iteration
        self._others: list = []  # the owner's other joinables, told to start what is ready
        self._announcing: bool | None = None  # ranks have joined: announce (None: not read yet)
        self._works: list[Work] = []  # i-variants' Works of this iteration (enabled Join only)
        self._active = self.size  # active ranks in the current iteration, once read
        self._highest: tuple = (None, 0, -1)  # (Join, active ranks, the highest active rank)
        self._alone_in: Join | None = None  # the Join where an iteration counted one active rank
        self._behind = False  # the only active rank applied kept results not yet sent (_catch_up)
        self._iteration = 0
        self._where = "iteration 0"
        self._persistent = self._persistent_everywhere()
        self._kept = KeptArrays()  # arrays kept current on every rank (keep())

    def elastic_progress(self) -> int | None:
        """The results applied to the kept arrays (:meth:`keep`), when it keeps any, else
        ``None`` (it owns no step)."""
        return int(self._kept.updates[0]) if self._kept else None

    def elastic_state(self) -> list[Any]:
        """The kept arrays and the count of results applied to them."""
        return [*self._kept.arrays, self._kept.updates] if self._kept else []

    def move_to(self, comm: MPI.Intracomm) -> None:
        """Work on `comm` from now on (an elastic Join's survivors); the kept arrays stay."""
        super().move_to(comm)
        self._row_headers = np.empty((self.size, 2), np.int64)
        self._owner, self._others, self._announcing, self._works = None, [], None, []
        self._active, self._highest, self._alone_in = self.size, (None, 0, -1), None
        self._rows, self._behind = {}, False
        self._persistent = self._persistent_everywhere()

    @property
    def persistent(self) -> PersistentCollectives | None:
        """The persistent collectives of the small operations while every rank is active, when
        ``TENSORPLAY_MPI_PERSISTENT`` turns them on (the JoinableComm page of the
        documentation), else ``None``."""
        return self._persistent

    def _persistent_everywhere(self) -> PersistentCollectives | None:
        """The persistent collectives, if ``TENSORPLAY_MPI_PERSISTENT`` turns them on on every
        rank; ``ValueError`` on every rank if on some only (collective: one allgather)."""
        refused: RuntimeError | None = None
        try:
            on = enabled()
        except RuntimeError as error:  # =1 where MPI has none
            on, refused = False, error
        what = "the TENSORPLAY_MPI_PERSISTENT check"
        agree_on_setting(lambda mine, every: iallgather(self.comm, mine, every, what),
                         self.rank, self.size, self.timeout, on, "TENSORPLAY_MPI_PERSISTENT",
                         "a persistent collective matches only a persistent one", refused)
        spins = 0 if oversubscribed() else SPINS  # a spinning rank holds a core a peer needs
        return PersistentCollectives(self.comm, self.timeout, spins) if on else None

    # -- kept arrays: the state every rank holds, joined ranks included ---------------------

    def keep(self, *arrays: Any) -> Any:
        """Keep `arrays` current on every rank, joined ones included.

        A kept array passed as ``out=`` of :meth:`allreduce` or :meth:`bcast` receives the
        result on every rank, or as ``into=`` of :meth:`allreduce` accumulates it
        (``into = op(into, result)``: ``+=`` for SUM); a rank that has joined applies the same
        result to its own kept array while it shadows, so after the Join every rank holds the
        same final state without more code, and in an elastic Join nothing already reduced
        is lost with a rank (the kept arrays and the count of results applied to them are
        this JoinableComm's state: :class:`~tensorplay_mpi.algorithms.ElasticJoinable`).

        Collective over ``comm``, outside an enabled Join: every rank keeps arrays of the same
        shapes and dtypes in the same order (``ValueError`` on every rank if not).

        Parameters
        ----------
        *arrays : NumPy arrays or torch CPU tensors
            Writeable, C-contiguous host arrays, kept by reference (not copied).

        Returns
        -------
        The array given (one), or a tuple of them.
        """
        join = self.join_context
        if join is not None and join.enabled:
            raise RuntimeError("JoinableComm.keep() is collective over every rank: call it "
                               "before the Join, not inside it")
        views, refused = self._kept.views(arrays)
        layout = [(v.shape, v.dtype.str) for v in [*self._kept.arrays, *views]]
        self._check_arguments(refused, layout, "kept arrays (shapes and dtypes, in order)",
                              f"{layout}")
        self._kept.add(arrays, views)
        return arrays[0] if len(arrays) == 1 else arrays

    @property
    def kept(self) -> tuple[Any, ...]:
        """The kept arrays, as given to :meth:`keep`, in slot order."""
        return tuple(self._kept.given)

    # -- iterations ------------------------------------------------------------------------

    def begin_iteration(self) -> None:
        """Start an iteration: the heartbeat when this is the first joinable.

        Collective over ``comm``.  The heartbeat is waited for at the first operation.
        """
        Join.notify_join_context(self)  # the Join owns the heartbeat it returns
        self._begin(self.join_context)

    def _begin(self, join: Join | None) -> None:
        """Start an iteration of this JoinableComm in `join` (``None``: outside any)."""
        self._next_iteration("")
        self._kept.used = False
        self._owner = join if join is not None and join.enabled else None
        self._others = [] if self._owner is None else [
            j for j in self._owner.joinables if j is not self
            and type(j).start_ready is not JoinableComm.start_ready]
        self._announcing = None

    def _follows_leader(self, join: Join | None) -> TypeGuard[Join]:
        """Whether another joinable leads `join` (sends its heartbeat): its iteration is then
        this JoinableComm's, begun by the first operation or announcement after the heartbeat
        (``begin_iteration()`` is not needed)."""
        return join is not None and join.enabled and not join.joined \
            and join.joinables[0] is not self

    def announce_block(self, index: int) -> None:
        """Announce joinable `index`'s block of collectives (see :meth:`Join.announce`)."""
        self._start_operation()
        if self._ranks_joined():
            self._announce(wire.BLOCK, count=index)

    def _elastic_owner(self) -> bool:
        """Whether this rank runs an iteration of an elastic Join of this JoinableComm."""
        join = self.join_context
        return join is not None and join.enabled and join.elastic and not join.runs_everywhere

    def _next_iteration(self, side: str) -> None:
        """Count an iteration, active or (`side` ``", joined"``) shadowed: errors name it."""
        self._iteration += 1
        self._where = f"iteration {self._iteration}{side}"

    def end_iteration(self) -> None:
        """Complete this iteration's dropped Works; announce END when ranks have joined."""
        join = self.join_context
        if self._owner is None and self._follows_leader(join) and join.iterations > 0:
            self._begin(join)  # an iteration without operations ends with END all the same
        if self._owner is not None and join is self._owner:  # not after an error
            self._wait_all(self._works)
            self._start_operation()
            if self._ranks_joined():
                if self._behind and join.save_due:  # on_save follows: every rank current
                    self._catch_up()
                self._announce(wire.END)
        self._works.clear()
        self._owner = self._announcing = None
        self._others = []

    def _start_operation(self) -> None:
        """What precedes every operation and announcement: begin the iteration of a Join that
        another joinable leads, check ``begin_iteration()``, start the buckets that are ready."""
        join = self.join_context
        if join is not None and join.runs_everywhere:
            return  # on_save, update=: every rank issues it here, as outside a Join
        if join is not self._owner and self._follows_leader(join):
            if join.iterations == 0:
                raise RuntimeError(
                    f"a JoinableComm operation before the first iteration of "
                    f"{type(join.joinables[0]).__name__}, the first joinable of the Join: its "
                    "iterations lead, so run every operation inside one or after it in the same "
                    "iteration (the forward pass of a SyncBatchNorm model inside `with "
                    "dp.step():`); a loop without steps (validation) needs a Join of its own, "
                    "`with Join([jc]):` and jc.begin_iteration() in each iteration")
            self._begin(join)
        if join is not self._owner:
            if join is not None and join.enabled:
                raise RuntimeError("call jc.begin_iteration() at the start of every iteration "
                                   "inside a Join, before its first operation")
            self._owner = self._announcing = None  # outside an enabled Join: retain nothing
            self._works.clear()
            return
        for other in self._others:  # buckets ready now start before this operation, on
            other.start_ready()  # every rank: the order never depends on timing

    def _ranks_joined(self) -> bool:
        """Whether ranks have joined in this iteration (waits for the heartbeat once per
        iteration): the data then goes where joined ranks follow.  False outside an enabled
        Join and in code that every rank runs (``on_save``, ``update=``)."""
        join = self.join_context
        if self._owner is None or join is not self._owner or join.runs_everywhere:
            return False
        if self._announcing is None:  # the first need in this iteration: the heartbeat
            self._active = join.active_ranks()
            self._announcing = self._active < self.size
            if self._active == 1 < self.size:  # and every later one: none comes back
                self._alone_in = join
        return self._announcing

    def _alone(self) -> bool:
        """Whether this rank is the only active one: the heartbeat of this iteration or of an
        earlier one of this Join counted one active rank (the count never grows).  Its
        operations then need no data collective: a result is its own input, and joined ranks
        receive only those applied to kept arrays (:meth:`_announce_alone`)."""
        if self._alone_in is None or self._alone_in is not self._owner:
            return False
        join = self.join_context
        return join is self._owner and not join.runs_everywhere

    def _announce_alone(self, x: Any, op: int, code: int, kept: int) -> None:
        """The only active rank's result `x` of an operation on a kept array (`op` 0: a
        broadcast), for the joined ranks: in an elastic Join, in the announcement's payload when
        it fits, else a broadcast from this rank after it, so that nothing applied is lost with
        this rank; in a Join of this JoinableComm alone, not now: the kept arrays are sent whole
        when a joined rank reads them (:meth:`_catch_up`)."""
        if _catches_up(self._owner):
            self._behind = True
            return
        small = x.nbytes <= 8 * wire.PAYLOAD
        words = wire.as_payload(x) if small else None
        self._announce(wire.ALONE, op, code, count=x.size, rows=kept << 2, payload=words)
        if not small:
            self._wait(ibcast(self.comm, x, self.rank, f"kept result ({self._where})"))

    def _catch_up(self) -> None:
        """Send the kept arrays whole, and their count of results, to the joined ranks (from
        this rank, the only active one, which applied results they have not): before
        ``on_save``, before a refused call raises.  When the Join ends, the hook's post_hook
        does it."""
        self._announce(wire.CATCH_UP)
        self._send_kept(self.rank)

    def _send_kept(self, root: int) -> None:
        """The kept arrays and their count of results, broadcast from `root`."""
        self._wait_all([ibcast(self.comm, array, root, f"kept array {i} ({self._where})")
                        for i, array in enumerate([*self._kept.arrays, self._kept.updates])])
        self._behind = False

    def _own(self, work: Work) -> Work:
        if self._owner is not None:  # completed at the end of the iteration
            self._works.append(work)
        return work

    # -- announcements -----------------------------------------------------------------------

    def _refuse(self, error: Exception) -> NoReturn:
        """Raise `error`, a bad argument, after announcing it: the other ranks raise too (the
        same kind where they refused as well, else :class:`CollectiveMismatchError`)."""
        self._start_operation()
        try:
            if self._behind:  # the joined ranks raise too: with the kept arrays current
                self._catch_up()
            self._announce(wire.REFUSED, kind_code(error))  # the code in the op field
        except CollectiveMismatchError as mismatch:
            raise error from mismatch
        raise error

    def _announce(self, kind: int, op: int = 0, code: int = 0, root: int = -1, count: int = 0,
                  rows: int = 0, payload: np.ndarray | None = None, writer: int = -1,
                  at: int = 0) -> tuple:
        """Announce an operation, with the `payload` of every active rank (MAX-reduced), or
        only of rank `writer`, from payload word `at` on: what every rank then finds in the
        announcement's payload.

        Raises
        ------
        CollectiveMismatchError
            On every rank, if the active ranks did not announce the same operation; this
            rank's message names its own call.
        """
        writes = payload is not None and (writer == -1 or writer == self.rank)
        fields = (kind, op, code, root, count, rows)
        sent = wire.encode(self._announcement, fields, self.rank, payload if writes else None,
                           self._rows, at)
        try:
            values = self._exchange_announcement(sent)
        except CollectiveMismatchError as error:
            raise CollectiveMismatchError(
                f"{error} This rank called {wire.describe(fields)}.") from None
        if self._announcing:  # the count of active ranks read in this iteration
            self._highest = (self._owner, self._active, values[wire.RANK])
        return values

    def _follow_announcement(self) -> tuple:
        """A joined rank's side of the next announcement: it announces nothing."""
        self._announcement.fill(wire.NOBODY)
        return self._exchange_announcement()

    def _exchange_announcement(self, sent: tuple | None = None) -> tuple:
        """The announcement allreduce, then the fields every rank checks the same way (quickly
        where they are this rank's own `sent` row: :func:`.announcements.decode`)."""
        what = f"announcement ({self._where})"
        if self._persistent is not None:  # every rank announces or follows: the same request
            self._persistent.allreduce_in_place(self._announcement, MPI.MAX, what)
        else:
            iallreduce(self.comm, MPI.IN_PLACE, self._announcement, MPI.MAX, what).wait_or_abort(
                self.timeout)
        return wire.decode(self._announcement, self.size, f"rank {self.rank}: the {what}", sent)

    # -- operations ------------------------------------------------------------------------

    def iallreduce(self, x: Any, op: MPI.Op = MPI.SUM, out: Any = None) -> Work:
        """Start an allreduce of `x` over the active ranks; the Work's result is `out`.

        Joined ranks contribute the identity of `op` (0 for SUM, 1 for PROD, the lowest value
        for MAX, ...).  `out` (shaped and typed like `x`, C-contiguous) receives the result; by
        default a new array (passing one saves an allocation per call); ``out=x`` reduces in
        place.  Inside a Join the library completes a Work that its caller drops when the
        iteration ends.  A MAX or MIN of host floats travels as integers in the order of the
        values, a NaN the extreme that wins: NaN propagates as in ``np.maximum``, the same on
        every rank (MPI leaves NaN to the order of reduction); it completes before it returns.
        """
        return self._allreduce(x, op, out, False)

    def allreduce(self, x: Any, op: MPI.Op = MPI.SUM, out: Any = None, *,
                  into: Any = None) -> Any:
        """Allreduce of `x` over the active ranks (see :meth:`iallreduce`).

        A host array of at most 4 KiB goes through a persistent collective while every rank is
        active (the JoinableComm page of the documentation): every rank must then call
        ``allreduce`` (not ``iallreduce``) for it, with a host array.  An `out` kept with
        :meth:`keep` receives the result on every rank, joined ones too; `into`, a kept array
        shaped and typed like `x`, accumulates it there (``into = op(into, result)``) on every
        rank, and the reduced value (not the accumulated one) is returned.
        """
        return self._allreduce(x, op, out, True, into)

    def _allreduce(self, x: Any, op: MPI.Op, out: Any, wait: bool, into: Any = None) -> Any:
        """:meth:`iallreduce` (`wait` False: a Work) or :meth:`allreduce` (the result)."""
        try:  # the common case inline: dict look-ups, no call
            given = x
            x = x if type(x) is np.ndarray and x.flags.c_contiguous else self._array(x)
            code = wire.DTYPE_CODES.get(x.dtype) or wire.dtype_code(x.dtype)
            op_code = wire.OP_CODES.get(id(op)) or wire.code_of_op(op)
            if x.dtype.kind not in wire.OP_KINDS[OPS[op_code - 1]]:
                wire.refuse_op(op_code, x.dtype)
            kept = self._kept.code(x, op_code, out, into) if self._kept or into is not None \
                else 0
            if kept and not wait:
                raise ValueError("a kept array takes the blocking allreduce and bcast (the "
                                 "result is applied before they return), not iallreduce")
            out, result = _output(x, out, given)
            if kept:
                self._kept.use_once_per_iteration(self._elastic_owner())
        except (TypeError, ValueError) as error:
            self._refuse(error)
        if kept:
            value = self._allreduce_data(x, op, op_code, code, out, result, True, kept)
            self._kept.apply(kept, op_code, out)
            return value
        return self._allreduce_data(x, op, op_code, code, out, result, wait, 0)

    def _allreduce_data(self, x: Any, op: MPI.Op, op_code: int, code: int, out: Any,
                        result: Any, wait: bool, kept: int) -> Any:
        """The announcement and the data of an allreduce whose arguments are checked."""
        self._start_operation()
        if self._alone():  # the result is `x` with the joined ranks' identities
            if op_code in _LOGICAL and x.dtype.kind != "b":  # integers: 0 or 1
                ACCUMULATE[OPS[op_code - 1]](x, wire.identity(op, x.dtype), out=out)
            elif out is not x:  # any other op leaves `x` as it is
                out[...] = x
            if kept:
                self._announce_alone(out, op_code, code, kept)
            return result if wait else _completed(result, f"allreduce ({self._where}, alone)")
        floats = x.dtype.kind == "f" and op_code in (wire.MAX_CODE, wire.MIN_CODE) \
            and type(x) is np.ndarray  # NaN: the same on every rank, through ordered keys
        data = wire.float_keys(x, op_code == wire.MAX_CODE) if floats else x
        reverse = wire.carried_op(data, op_code)
        if reverse is not None:  # small and ordered: the announcement carries the data
            self._announce(wire.CARRIED_ALLREDUCE, op_code, wire.DTYPE_CODES[data.dtype],
                           count=x.size, rows=_variant(False, floats, kept),
                           payload=wire.order_keys(data, reverse))
            keys = self._announcement[wire.PAYLOAD_AT:wire.PAYLOAD_AT + x.size]
            data = wire.from_order_keys(keys, data.dtype, reverse)
        elif wire.sums_in_slots(x, op_code, self.size):  # each rank's values in its slots
            self._announce(wire.SLOT_SUM, op_code, code, count=x.size, rows=kept << 2,
                           payload=wire.slot_words(x), at=self.rank * x.size)
            data = wire.slot_sum(self._announcement, x.dtype, x.size, self.size)
        else:
            persistent = (wait or floats) and _fits_persistent(data)
            self._announce(wire.ALLREDUCE, op_code, code if data is x else
                           wire.DTYPE_CODES[data.dtype], count=x.size,
                           rows=_variant(persistent, floats, kept))
            what = f"allreduce ({self._where})"
            if persistent and self._persistent is not None and not self._ranks_joined():
                self._persistent.allreduce(data, data if floats else out, op, op_code, what)
            elif floats:
                self._wait(iallreduce(self.comm, MPI.IN_PLACE, data, op, what))
            else:
                send = MPI.IN_PLACE if out is x else x
                work = self._own(iallreduce(self.comm, send, result, op, what))
                return self._wait(work) if wait else work
            if not floats:
                return result if wait else _completed(result, what)
        out[...] = (wire.float_values(data, x.dtype) if floats else data).reshape(x.shape)
        return result if wait else _completed(result, f"allreduce ({self._where}, in the "
                                                      "announcement or as ordered integers)")

    def iallgather(self, rows: Any) -> Work:
        """Start a gather of every active rank's rows, in rank order; the result is an array.

        `rows` has shape ``(r, ...)``; ``r`` may differ per rank, the dtype and the other
        dimensions may not (``ValueError`` on every rank).  The row headers are exchanged (and
        waited for) first; the Work is the data's allgatherv.
        """
        given = rows
        try:
            rows = self._array(rows)
            if rows.ndim < 1:
                raise ValueError(f"allgather needs rows of at least one dimension, got shape "
                                 f"{rows.shape}")
            code = wire.dtype_code(rows.dtype)
        except (TypeError, ValueError) as error:
            self._refuse(error)
        row_digest = ints_digest((code,) + rows.shape[1:])
        self._start_operation()
        if self._alone():  # the only rows
            return _completed(like(given, rows.copy()), f"allgather ({self._where}, alone)")
        self._announce(wire.ALLGATHER, 0, code, count=math.prod(rows.shape[1:]), rows=row_digest)
        return self._own(self._gather_rows(rows, row_digest, given))

    def allgather(self, rows: Any) -> Any:
        """The active ranks' rows, concatenated in rank order (see :meth:`iallgather`)."""
        return self._wait(self.iallgather(rows))

    def _gather_rows(self, rows: Any, row_digest: int, given: Any = None) -> Work:
        """The row headers, then the data's allgatherv into a new array of `given`'s kind."""
        self._row_header[:] = rows.shape[0], row_digest
        headers = self._wait(iallgather(self.comm, self._row_header, self._row_headers,
                                        f"row counts ({self._where})"))
        counts, digests = headers[:, 0], headers[:, 1]
        gathering = np.flatnonzero(digests != _JOINED)  # a joined rank's rows say nothing
        differ = np.flatnonzero(digests[gathering] != digests[gathering[0]]).tolist()
        if differ:
            mine = "" if row_digest == _JOINED else (f" (rank {self.rank} has {rows.dtype} rows "
                                                      f"of shape {rows.shape[1:]})")
            raise ValueError(f"allgather needs rows of one dtype and the same trailing "
                             f"dimensions on every rank: ranks {gathering[differ].tolist()} "
                             f"differ from rank {gathering[0]}{mine}")
        total, row_size = int(counts.sum()), math.prod(rows.shape[1:])
        out = zeros_like(rows, total * row_size).reshape((total,) + tuple(rows.shape[1:]))
        return iallgatherv(self.comm, rows, like(given, out), (counts * row_size).tolist(),
                           f"allgather ({self._where})")

    def ibcast(self, x: Any, root: int | str = "highest_active", out: Any = None) -> Work:
        """Start a broadcast from `root`; the Work's result is `out` (the root's data).

        `root` is an active rank, or ``"highest_active"``.  An int root that has joined (or is
        no rank) raises ``ValueError`` on every rank, joined ones included.  `out` (shaped and
        typed like `x`, C-contiguous) receives the data; by default a new array.
        """
        return self._bcast(x, root, out, False)

    def _bcast(self, x: Any, root: int | str, out: Any, wait: bool) -> Any:
        """:meth:`ibcast` (`wait` False: a Work) or :meth:`bcast` (the result); a kept `out`
        receives it on every rank (:meth:`keep`)."""
        try:
            kept = self._kept.out_slot(out) if self._kept else None
            if kept is not None and not wait:
                raise ValueError("a kept array takes the blocking allreduce and bcast (the "
                                 "result is applied before they return), not ibcast")
            if kept is not None:
                self._kept.use_once_per_iteration(self._elastic_owner())
        except ValueError as error:
            self._refuse(error)
        if kept is None:
            return self._bcast_data(x, root, out, wait, 0)
        value = self._bcast_data(x, root, out, True, kept << 2 | OUT)
        self._kept.updates += 1
        return value

    def _bcast_data(self, x: Any, root: int | str, out: Any, wait: bool, kept: int) -> Any:
        """:meth:`ibcast` (`wait` False: a Work) or :meth:`bcast` (the result)."""
        try:
            given = x
            x = x if type(x) is np.ndarray and x.flags.c_contiguous else self._array(x)
            code = wire.DTYPE_CODES.get(x.dtype) or wire.dtype_code(x.dtype)
            out, result = _output(x, out, given)
            highest = isinstance(root, str) and root == "highest_active"
            if not highest and (isinstance(root, bool)
                                or not isinstance(root, (int, np.integer))):
                raise TypeError(f"root must be an int or 'highest_active', got {root!r}")
            target = -1 if highest else int(root)
            _check_root(target, highest or 0 <= target < self.size)
        except (TypeError, ValueError) as error:
            self._refuse(error)
        self._start_operation()
        if target in (-1, self.rank) and self._alone():  # another root: refused below
            if kept:
                self._announce_alone(x, 0, code, kept)
            if out is not x:
                out[...] = x
            return result if wait else _completed(result, f"bcast ({self._where}, alone)")
        writer = self._carrier(x, target)
        if writer is not None:  # small, and its root known: the announcement carries it
            words = wire.as_payload(x)
            values = self._announce(wire.CARRIED_BCAST, 0, code, target, x.size,
                                    rows=kept << 2, payload=words, writer=writer)
            _check_root(target, highest or values[wire.ROOT_IS_ME] == 1)
            out[...] = wire.from_payload(self._announcement, x.dtype, x.size).reshape(x.shape)
            return result if wait else _completed(result, f"bcast ({self._where}, carried)")
        persistent = wait and _fits_persistent(x)
        values = self._announce(wire.BCAST, 0, code, target, x.size,
                                rows=int(persistent) | kept << 2)
        if self._ranks_joined():
            target = values[wire.RANK] if highest else target
            _check_root(target, highest or values[wire.ROOT_IS_ME] == 1)
        else:
            target = self.size - 1 if highest else target
            if persistent and self._persistent is not None:
                self._persistent.bcast(x, out, target, f"bcast from {target} ({self._where})")
                return result
        if self.rank == target and out is not x:
            out[...] = x
        work = self._own(ibcast(self.comm, result, target, f"bcast from {target} ({self._where})"))
        return self._wait(work) if wait else work

    def _carrier(self, x: Any, root: int) -> int | None:
        """The rank whose small `x` an announcement carries: `root`, or the highest active
        rank when known: every rank's while none has joined, else the one an earlier
        announcement named with the same count of active ranks (in one Join, the same ranks)."""
        if type(x) is not np.ndarray or x.nbytes > 8 * wire.PAYLOAD:
            return None
        if root != -1:
            return root
        if not self._ranks_joined():
            return self.size - 1
        join, active, highest = self._highest
        return highest if join is self._owner and active == self._active else None

    def bcast(self, x: Any, root: int | str = "highest_active", out: Any = None) -> Any:
        """The root's `x` on every active rank (see :meth:`ibcast`).

        A small host array goes through a persistent collective while every rank is active,
        as in :meth:`allreduce`: every rank must then call ``bcast`` for it.
        """
        return self._bcast(x, root, out, True)

    def _array(self, x: Any) -> Any:
        """`x` as an array MPI can send: C-ordered (a copy if it was not), on its device; a
        torch tensor or a CPU DLPack exporter as the NumPy (CuPy) view of its memory; a host array
        of another ndarray type (``np.memmap``, ``np.matrix``) as a plain view, so that the
        path an operation takes never depends on one rank's array type.  A torch CUDA
        tensor's memory is read after torch's pending kernels (:func:`.torch_cuda.take`)."""
        if isinstance(x, np.ndarray) and not is_device_array(x):
            x = x.view(np.ndarray)
        elif type(x) is not np.ndarray:
            x = as_array(x)
            if not hasattr(x, "dtype") or not hasattr(x, "shape") or isinstance(x, np.generic):
                return np.asarray(x)  # a NumPy scalar (arr.max()) takes a 0-d array's path
            self.device = device_of(x)
            torch_cuda.take()  # nothing unless torch CUDA tensors are in use
        return x if misordered(x) is None else x.copy(order="C")

    # -- Joinable ------------------------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _FollowAnnouncements(self)

    def _made_into(self, join: Join) -> None:
        """`join` was made with this JoinableComm: a second JoinableComm in it, or a Join that
        the layers issuing their collectives through it (SyncBatchNorm's) cannot run in, is
        refused on every rank before anything starts."""
        count = sum(isinstance(joinable, JoinableComm) for joinable in join.joinables)
        if count > 1:
            raise ValueError(
                f"a Join holds at most one JoinableComm, got {count}: a joined rank follows the "
                f"announcements of its communicator in order, and two JoinableComms on one "
                f"communicator would interleave them; issue every operation of the loop "
                f"through one JoinableComm (SyncBatchNorm layers take it as process_group)")
        super()._made_into(join)

    def __deepcopy__(self, memo: dict) -> "JoinableComm":
        """The same object: a copy of what holds it (a model, a torchmetrics metric) shares
        the communicator and its iteration, as it shares ``MPI.COMM_WORLD``."""
        return self


def _output(x: Any, out: Any, given: Any) -> tuple[Any, Any]:
    """The array that receives the result, checked, and the result to return: the caller's
    `out`, or a new array like `x` (the C-ordered array of the caller's input `given`), a torch
    tensor when `given` is one."""
    if out is None:
        new = np.empty_like(x) if type(x) is np.ndarray else zeros_like(x)
        return new, like(given, new)
    if out is x:
        _refuse_read_only(out)
        return out, out
    if (type(out) is np.ndarray and out.base is None and x.base is None and out.shape == x.shape
            and out.dtype == x.dtype and out.flags.c_contiguous
            and out.flags.writeable):  # the common case: no more to check (two arrays
        return out, out  # without a base cannot overlap)
    result, out = out, as_array(out, "out")
    if is_device_array(out):
        torch_cuda.take()  # written after torch's pending kernels on a torch CUDA tensor
    _refuse_read_only(out)
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out must be shaped and typed like the input: {x.shape} {x.dtype}, "
                         f"got {out.shape} {out.dtype}")
    layout = misordered(out)
    if layout is not None:
        remedy = ("pass none and copy the result in with out.copy_(result) (out.contiguous() "
                  "would be a copy)" if is_tensor(result) else
                  "pass a C-contiguous out, or none and copy the result")
        raise ValueError(f"out must be C-contiguous (MPI writes it in memory order), got a "
                         f"{layout} array{' (out=x)' if result is given else ''}: {remedy}")
    if result is given:  # out=x of a tensor: in place, in the memory `x` views
        return x, result
    if (isinstance(out, np.ndarray) and isinstance(x, np.ndarray)  # np.memmap too
            and (out.base is not None or x.base is not None)  # else they cannot overlap
            and np.may_share_memory(out, x)):
        raise ValueError("out overlaps the input without being it; pass out=x to work in place")
    return out, result


def _refuse_read_only(out: Any) -> None:
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise ValueError("out is read-only, and the result is written into it: pass a "
                         "writeable array, or none")


_JOINED = 0
"""The row digest a joined rank sends with its zero rows (no digest is 0)."""


def _variant(persistent: bool, floats: bool, kept: int) -> int:
    """The announced variant of an allreduce (in the row digest's field): whether it goes
    through a persistent collective while every rank is active, whether its floats travel
    as ordered integers, and the use of a kept array (:meth:`.KeptArrays.code`).
    Active ranks must agree on all three."""
    return int(persistent) | int(floats) << 1 | kept << 2


def _catches_up(join: Join | None) -> bool:
    """Whether the last active rank of `join` sends its kept arrays whole where joined ranks
    read them (:meth:`JoinableComm._catch_up`) instead of each result: a Join of the
    JoinableComm alone (no other joinable runs code of its own on joined ranks, such as a
    DataParallel's ``update=``) that is not elastic (where a lost last rank would lose them)."""
    return join is not None and not join.elastic and len(join.joinables) == 1


def _check_root(root: int, active: bool) -> None:
    if not active:
        raise ValueError(f"bcast root {root} is not an active rank (it has joined, or is no "
                         "rank); use an active rank or root='highest_active'")


class _FollowAnnouncements(JoinHook):
    _CACHED = 8  # shadow buffers kept, for the most recent operations' shapes

    def __init__(self, jc: JoinableComm) -> None:
        self.jc = jc
        self._buffers: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def _shadow_buffers(self, op: int, count: int, dtype: np.dtype) -> tuple:
        """A joined rank's contribution and receive buffer, made once per op, count and dtype."""
        key = (op, count, dtype)
        buffers = self._buffers.pop(key, None)
        if buffers is None:
            fill = wire.identity(wire.OP_OBJECTS[op - 1], dtype) if op else 0
            buffers = np.full(count, fill, dtype), np.empty(count, dtype)
        self._buffers[key] = buffers  # most recent last
        if len(self._buffers) > self._CACHED:
            del self._buffers[next(iter(self._buffers))]
        return buffers

    def _apply_alone(self, op: int, code: int, count: int, rows: int, alone: int) -> None:
        """Apply the only active rank's result (rank `alone`) to the kept array `rows` names:
        from the announcement's payload, or from its broadcast when it did not fit."""
        jc, dtype = self.jc, wire.DTYPES[code - 1]
        if count * dtype.itemsize <= 8 * wire.PAYLOAD:
            values = wire.from_payload(jc._announcement, dtype, count)
        else:
            values = self._shadow_buffers(0, count, dtype)[1]
            jc._wait(ibcast(jc.comm, values, alone, f"kept result ({jc._where})"))
        jc._kept.apply(rows >> 2, op, values)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Once every rank has joined a Join where the last active rank sends its kept arrays
        whole (:func:`_catches_up`): its kept arrays, if it applied results it did not send,
        reach every rank (an ``Iallreduce`` of its rank, then its broadcasts)."""
        jc = self.jc
        join = jc.join_context
        if not jc._kept or not _catches_up(join):
            return
        sender = np.array([jc.rank if jc._behind else -1], np.int64)
        jc._wait(iallreduce(jc.comm, MPI.IN_PLACE, sender, MPI.MAX, "kept arrays' sender"))
        if sender[0] >= 0:
            jc._send_kept(int(sender[0]))

    def main_hook(self) -> None:
        """Shadow one active iteration: follow the announcements until END."""
        jc = self.jc
        jc._next_iteration(", joined")
        while True:
            kind, op, code, root, count, rows, _, _, root_active, highest = (
                jc._follow_announcement())
            if kind == wire.END:
                return
            if kind == wire.BLOCK:  # DataParallel's step, an optimizer's: its hook, here
                BlockStream.of(jc.join_context).shadow(count)
                continue
            if kind == wire.CARRIED_ALLREDUCE:
                if rows >> 2:
                    jc._kept.apply_carried(rows >> 2, op, code, count, bool(rows & 2),
                                           jc._announcement)
                continue
            if kind == wire.SLOT_SUM:
                if rows >> 2:
                    jc._kept.apply(rows >> 2, op, wire.slot_sum(
                        jc._announcement, wire.DTYPES[code - 1], count, jc.size))
                continue
            if kind == wire.CARRIED_BCAST:
                _check_root(root, root == -1 or root_active == 1)
                if rows >> 2:
                    kept = jc._kept.arrays[rows >> 4]
                    jc._kept.apply(rows >> 2, 0,
                                   wire.from_payload(jc._announcement, kept.dtype, kept.size))
                continue
            if kind == wire.ALONE:  # a result of the only active rank, for a kept array
                self._apply_alone(op, code, count, rows, highest)
                continue
            if kind == wire.CATCH_UP:  # the only active rank's kept arrays, whole
                jc._send_kept(highest)
                continue
            if kind == wire.REFUSED:
                raise KINDS[op - 1](
                    f"rank {jc.rank}: the active ranks' JoinableComm call in {jc._where} had a "
                    f"bad argument (they raised {KINDS[op - 1].__name__})")
            dtype = wire.DTYPES[code - 1]
            if kind == wire.ALLREDUCE:
                contribution, received = self._shadow_buffers(op, count, dtype)
                jc._wait(iallreduce(jc.comm, contribution, received, wire.OP_OBJECTS[op - 1],
                                    f"allreduce ({jc._where})"))
                if rows >> 2:  # floats as ordered integers: back to the kept dtype
                    values = (wire.float_values(received, jc._kept.arrays[rows >> 4].dtype)
                              if rows & 2 else received)
                    jc._kept.apply(rows >> 2, op, values)
            elif kind == wire.ALLGATHER:
                jc._wait(jc._gather_rows(np.empty((0, count), dtype), _JOINED))
            else:
                target = highest if root == -1 else root
                _check_root(target, root == -1 or root_active == 1)
                received = self._shadow_buffers(0, count, dtype)[1]
                jc._wait(ibcast(jc.comm, received, target, f"bcast from {target} ({jc._where})"))
                if rows >> 2:
                    jc._kept.apply(rows >> 2, 0, received)
