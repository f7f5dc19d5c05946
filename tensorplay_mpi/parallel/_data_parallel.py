"""DataParallel: bucketed, overlapped gradient averaging as a Joinable.

Wire schedule of one active step (a joined rank's main hook shadows exactly this):

1. the heartbeat (Join's, when ``dp`` is the first joinable), started when the step starts.  The
   step waits for it, which gives ``n``, the number of active ranks, only where ``n`` is first
   needed: before the first bucket (in ``mark_ready`` or at the step's end).  With even inputs
   the heartbeat thus completes in the shadow of the backward pass, and the step has no
   synchronisation point that plain data parallelism does not have;
2. only when ``n < size``, the step control, two allreduces started together:
   ``Iallreduce(int64[5], SUM)`` of ``[active, syncs, votes for dividing by the world size,
   votes for dividing by the active ranks, ranks averaging per sample]`` (active ranks send
   ``[1, syncs, 0, 0, s]``, joined ranks ``[0, 0, d, 1 - d, 0]`` from their Join's
   ``divide_by_initial_world_size``) and
   ``Iallreduce(int64[1], MAX)`` of the rank (joined ranks send -1): the count, the sync flag,
   the divisor and the highest active rank, the root of the buffer broadcast.  Its size does not
   grow with the number of ranks;
3. when the step synchronises: one ``Iallreduce(IN_PLACE, SUM)`` per bucket, in bucket order
   (float32 for a half-precision bucket; with ``compress=``, a uint16 wire and a user-defined
   16-bit sum);
4. when there are buffers, at the step's end: one ``Ibcast`` per buffer from the highest active
   rank, so that every rank holds the same buffers wherever a user can look (a save included).

In a Join with a stream (a JoinableComm: ``Join([dp, jc])``), while ranks have joined, 2-4 run
together at the step's end, after an announcement of the block (``Join.announce``), so that a
joined rank shadows them where the active ranks issue them among the JoinableComm's operations
(SyncBatchNorm's statistics); with every rank active, the buckets ready when another joinable
issues a collective start before it (:meth:`DataParallel.start_ready`).

With even inputs a step therefore costs the heartbeat, the bucket allreduces and nothing else;
both divisors are then the world size.  A step that fails on every rank (the same bug
everywhere) agrees on the number of buckets the furthest rank started; every rank starts the
ones it lacks and completes them all, so nothing stays pending and the next Join works.

The user's side lives here: the arguments (checked in :mod:`.checks`), ``dp.step()`` and
``dp.no_sync()``, the Joinable.  The wire is the :class:`~.reducer.Reducer`'s, which a
DataParallel owns, as torch's DDP is a Module over a Reducer.
"""

from __future__ import annotations

import contextlib
import numbers
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from mpi4py import MPI

from ..algorithms._guarded_joinable import GuardedJoinable
from ..algorithms.join import ElasticJoinable, Join, Joinable, JoinHook
from ._checks import check_construction, check_step
from ._gradient_link import PlaceCheck
from ._layer_stream import LayerLinks
from ._narrow import format_name
from ._reducer import Reducer, Step

_ENTERED: list[Step] = []  # the dp.step() blocks this process is inside, innermost last


def current_step() -> tuple[int, int | None] | None:
    """``(micro_batches, samples)`` of the innermost ``dp.step()`` this process is inside (any
    DataParallel), None outside every step.  Read by a layer whose backward pass mixes the
    ranks' gradients (SyncBatchNorm), so that it weights them as the step does and checks
    that every rank runs the step's micro-batches alike.  Not thread-local: torch runs a CUDA
    backward pass on a thread of its own."""
    if not _ENTERED:
        return None
    step = _ENTERED[-1]
    return step.micro_batches, step.samples


@contextlib.contextmanager
def _entered(step: Step) -> Iterator[None]:
    """`step` in :data:`_ENTERED` while the caller's ``with dp.step():`` block runs."""
    _ENTERED.append(step)
    try:
        yield
    finally:
        _ENTERED.remove(step)


class _MustEnter:
    """A context manager of ``dp`` that ``dp`` remembers until it is entered.

    ``dp.step()`` or ``dp.no_sync()`` written without ``with`` does nothing; the next use of
    ``dp`` (a step, ``mark_ready``, the Join's next heartbeat or its exit) raises instead, on
    every rank, since every rank runs the same code.
    """

    __slots__ = ("_dp", "_manager", "usage")

    def __init__(self, dp: "DataParallel", manager: Any, usage: str) -> None:
        dp._check_entered()
        self._dp, self._manager, self.usage = dp, manager, usage
        dp._unentered = self

    def __enter__(self) -> Any:
        self._dp._unentered = None
        return self._manager.__enter__()

    def __exit__(self, *exc_info: Any) -> Any:
        return self._manager.__exit__(*exc_info)


class DataParallel(GuardedJoinable, ElasticJoinable):
    """Average gradients over ranks, in buckets, with uneven numbers of batches per rank.

    Collective over `comm`: every rank constructs it, with the same parameter shapes and
    dtypes, `bucket_cap_mb` and `broadcast_from`; the constructor checks that (and every
    rank's arguments) before it broadcasts `params` and `buffers` from `broadcast_from`, so a
    misuse on any rank raises on every rank.

    Parameters
    ----------
    params : sequence of arrays or torch tensors
        The trained arrays (NumPy or CuPy, or torch tensors such as ``model.parameters()``,
        on the CPU or CUDA; all on one device), owned and updated in place by the caller; writeable,
        C-contiguous float32 or float64, or on the CPU float16 or bfloat16 (one bucket set per
        dtype; half precision is summed and divided in float32, then rounded once).  Buckets,
        zeroing and averaging stay on that device.  A torch parameter that requires gradients gets
        ``p.grad`` bound to its bucket view, so that ``loss.backward()`` writes there; the
        binding is repaired at each step (``model.zero_grad()`` unbinds it).
    comm : mpi4py.MPI.Intracomm, optional
        Defaults to ``MPI.COMM_WORLD``; see
        :class:`~tensorplay_mpi.algorithms.GuardedJoinable`.
    bucket_cap_mb : float, default 25.0
        Largest bucket in MiB (a larger parameter gets a bucket of its own).
    broadcast_from : int, default 0
        The rank whose params and buffers every rank starts from.
    buffers : sequence of arrays or torch tensors, default ()
        Non-trained state (running statistics, ``model.buffers()``, ...): broadcast at each
        step start from the highest active rank, as DDP's ``broadcast_buffers``.
    timeout : float, optional
        Seconds any wait may take (default ``$TENSORPLAY_MPI_TIMEOUT`` or 1800).
    overlap : bool, default True
        With torch parameters: each one's post-accumulate-grad hook calls :meth:`mark_ready`,
        so buckets start reducing during ``loss.backward()``.  To accumulate K micro-batches
        (K backward passes) in one step, enter it as ``with dp.step(micro_batches=K):``.
    update : callable, optional
        ``update()``, no argument: run on every rank once per synchronising step, after the
        gradients are averaged: on an active rank at the end of ``with dp.step():``, on a
        joined rank in its shadow of that step.  Put the optimizer step there, with whatever
        goes with it (``clip_grad_norm_``, ``opt.step()``, ``sched.step()``): parameters,
        optimizer and scheduler state then stay identical on every rank, with any optimizer.
        An exception in it raises on every rank.  The recommended torch loop.
    compress : {None, "bf16", "fp16"}, default None
        Reduce float32 gradients in 16 bits on the wire, as DDP's ``bf16_compress_hook`` and
        ``fp16_compress_hook``: each rank's bucket is divided, rounded to bfloat16 (float16),
        summed in that format (every addition rounds) and widened back into the float32
        bucket.  Half the bytes on the wire, a 16-bit format's precision in the average;
        replicas stay bitwise identical.  float32 params on the CPU; not with
        ``dp.step(samples=)``.

    Attributes
    ----------
    grads : GradientViews
        One gradient per parameter, shaped like it: zero-copy views into the buckets (torch
        tensors when `params` are).  Write the local gradient there during a step; after the
        step it holds the average.
    used : numpy.ndarray of bool
        Per parameter: whether any rank produced a gradient for it in the last synchronising
        step (before the first, True but for frozen parameters).
    samples : int
        The active ranks' samples in the last step entered with ``samples=`` (the union's
        size, the same on every rank, joined ones included): a schedule keyed on samples seen
        stays right across a resize.  The library's optimizers
        step only these, as torch.optim steps only parameters whose ``p.grad`` is not None.

    Notes
    -----
    Parameters without a gradient follow torch.optim.  A torch ``Parameter`` with
    ``requires_grad=False`` when DataParallel is built is frozen: it gets no bucket, its
    ``p.grad`` stays None and ``used`` is False for it; freezing or unfreezing a parameter
    afterwards raises ``RuntimeError`` at the next step (build a new DataParallel).  A torch
    parameter that no rank's autograd gave a gradient in a step (``model.zero_grad()`` then a
    backward pass that does not reach it) ends the step with ``p.grad is None`` on every rank;
    where some ranks gave one, it is averaged with zeros from the others.  Arrays (and
    tensors trained by hand) are used by default; a rank passes ``dp.step(unused=indices)``
    for those it produced no gradient for in that step.

    SyncBatchNorm layers converted without a group (``convert_sync_batchnorm(model)``, as
    torch users write it) among the parameters or buffers: the DataParallel holds a
    :class:`~tensorplay_mpi.JoinableComm` on `comm` for them (made here), and a Join made with
    it holds that JoinableComm too, after the listed joinables, unless the caller lists one of
    their own; the layers reduce through the running Join's JoinableComm.  So ``Join([dp])``,
    ``Join([dp, opt])`` work with such a model as ``Join([dp, jc])`` does with layers
    converted with ``jc``.  A Join holds at most one DataParallel.

    Raises
    ------
    TypeError
        On every rank, if a rank passed one array instead of a sequence, a non-array, integer
        or object params, half-precision params on a GPU, or a `broadcast_from` that is not an
        int.
    ValueError
        On every rank, if a rank passed non-contiguous or read-only arrays, arrays on several
        devices, ``bucket_cap_mb <= 0``, a `broadcast_from` that is not a rank, or if ranks
        passed different shapes/dtypes, `bucket_cap_mb`, `broadcast_from` or numbers of
        SyncBatchNorm layers without a group; when a Join is made with it and another
        DataParallel.

    Examples
    --------
    ::

        dp = DataParallel(params)
        with Join([dp], divide_by_initial_world_size=True):
            for batch in my_batches:
                with dp.step():
                    backward(params, batch, out=dp.grads)
                update(params, dp.grads)

    A torch model with any torch optimizer, exact on every rank (a joined rank runs the
    update in its shadow of each step)::

        opt = torch.optim.AdamW(model.parameters())
        dp = DataParallel(model.parameters(), buffers=model.buffers(), update=opt.step)
        with Join([dp]):
            for x, y in my_batches:
                model.zero_grad()
                with dp.step():
                    loss_fn(model(x), y).backward()
    """

    _announces_blocks = True  # its step: one announced block

    def __init__(
        self,
        params: Sequence[np.ndarray],
        comm: MPI.Intracomm | None = None,
        bucket_cap_mb: float = 25.0,
        broadcast_from: int = 0,
        buffers: Sequence[np.ndarray] = (),
        timeout: float | None = None,
        overlap: bool = True,
        update: Callable[[], Any] | None = None,
        compress: str | None = None,
    ) -> None:
        super().__init__(comm, timeout)
        refused, layout = None, None
        try:
            args = check_construction(params, buffers, bucket_cap_mb, broadcast_from, update,
                                      self.size, compress)
            broadcast_from = args.broadcast_from
            links = LayerLinks([*args.given, *args.given_buffers])
            layout = ([(a.shape, format_name(a.dtype)) for a in args.params],
                      [(a.shape, a.dtype.str) for a in args.buffers],
                      [i for i, f in enumerate(args.frozen) if f], compress, links.streamless)
        except (TypeError, ValueError) as error:
            refused = error
        self._check_arguments(refused, layout, "parameter or buffer shapes/dtypes, frozen "
                              "parameters, compress, or SyncBatchNorm layers without a group",
                              f"params {layout and layout[0]}, buffers {layout and layout[1]}, "
                              f"frozen params {layout and layout[2]}, "
                              f"compress={layout and layout[3]!r} and "
                              f"{layout and layout[4]} layers without a group",
                              broadcast_from=broadcast_from, bucket_cap_mb=bucket_cap_mb)
        self.params, self.buffers, self.device = args.params, args.buffers, args.device
        self.compress = args.compress
        self._reducer = Reducer(self, args, bucket_cap_mb * 2**20, overlap)
        self.grads, self.used = self._reducer.grads, self._reducer.used
        self._layers = links
        links.make_stream(self.comm, self.timeout)  # collective: every rank agreed above
        self._place_check = PlaceCheck()
        self.samples = 0  # the active ranks' samples in the last step with samples=
        self._unentered: _MustEnter | None = None  # a step() or no_sync() never entered

    @property
    def steps(self) -> int:
        """Steps taken: this rank's ``dp.step()`` blocks plus the steps it shadowed once
        joined, so the same on every rank at every iteration boundary (inside a Join's
        ``on_save``, where a joined rank runs no loop of its own), across Joins.  A step
        counter for saves and per-step schedules; set it after a resume
        (``dp.steps = resumed.step``)."""
        return self._reducer.steps

    @steps.setter
    def steps(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"steps must be an int >= 0, got {value!r}")
        self._reducer.steps = int(value)

    # -- the public step API --------------------------------------------------------------

    def join(self, **kwargs: Any) -> Join:
        """Shorthand for ``Join([self], **kwargs)``."""
        return Join([self], **kwargs)

    def _check_entered(self) -> None:
        """Raise ``RuntimeError`` if a step() or no_sync() was called without ``with``."""
        forgotten = self._unentered
        if forgotten is not None:
            self._unentered = None  # said once
            raise RuntimeError(
                f"dp.{forgotten.usage}() was called without `with`, so it did nothing (no "
                f"gradient was averaged): write `with dp.{forgotten.usage}():`")

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Steps entered inside skip the gradient averaging; gradients accumulate locally.

        Use it as ``with dp.no_sync():`` around ``with dp.step():``.  Every active rank must
        use it for the same steps (checked when a rank has joined).
        """
        return _MustEnter(self, self._no_sync(), "no_sync")

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        reducer = self._reducer
        if reducer.step is not None:
            raise RuntimeError("no_sync() must be entered outside a step, around dp.step()")
        join = self.join_context
        if join is not None and join.elastic:
            raise RuntimeError(
                "no_sync() inside an elastic Join: a lost rank's accumulated gradients could "
                "not be settled (the samples of an interrupted accumulation would be counted "
                "wrong); accumulate with dp.step(micro_batches=...) or leave elastic off")
        previous, reducer.sync = reducer.sync, False
        try:
            yield
        finally:
            reducer.sync = previous

    def zero_grad(self) -> None:
        """Set every gradient to zero (for example before accumulating with no_sync)."""
        self._reducer.zero_grads()

    def step(self, micro_batches: int = 1, unused: Sequence[int] = (),
             samples: int | None = None) -> contextlib.AbstractContextManager["DataParallel"]:
        """One training step, as ``with dp.step():``: heartbeat on enter; on exit every bucket
        is averaged, then ``update`` runs (when given).

        Parameters
        ----------
        micro_batches : int, default 1
            Backward passes per parameter in this step: with K, the gradients of K
            micro-batches accumulate inside the step (``loss_k.backward()`` K times; each
            ``p.grad`` sums them, as without DataParallel) and are averaged once.  This is
            the accumulation that works inside a Join with any optimizer; with the overlap, a
            parameter's bucket starts after its K-th gradient.  K may differ between ranks,
            but not in a model with SyncBatchNorm layers, whose statistics are collectives of
            each micro-batch (``ValueError`` on every rank: run empty micro-batches).
        unused : sequence of int
            Indices of array (not autograd) parameters this rank produced no gradient for in
            this step (see the class notes); torch parameters are read from autograd.
        samples : int, optional
            Average per sample instead of per rank: this rank's gradient is the mean over
            `samples` samples (its loss a mean over its batch), and the step's gradient is
            the mean over every active rank's samples, ``sum(samples_r * grad_r) /
            sum(samples_r)``: the gradient of the mean loss over the union of the batches, as
            a serial run computes it, whatever the batch sizes (SyncBatchNorm layers included:
            their backward pass weights the ranks alike).  Every active rank passes it
            for the same steps (else ``RuntimeError``); the counts ride in the bucket
            allreduces (no message of their own).  A step without samples anywhere averages
            to zero.

        Collective over ``comm``.  Inside a Join, ``dp`` must be its first joinable (it reads
        the heartbeat).  Outside a Join every rank is taken to be active: with uneven inputs
        the ranks with more batches then wait forever in their bucket allreduce, as they
        would with plain MPI; use a Join.  Called without ``with`` it does nothing, and the
        next use of ``dp`` raises ``RuntimeError``.
        """
        micro_batches, unused_indices, samples = check_step(micro_batches, unused, samples,
                                                            self._reducer.bound, self.compress)
        return _MustEnter(self, self._run_step(micro_batches, unused_indices, samples), "step")

    @contextlib.contextmanager
    def _run_step(self, micro_batches: int, unused: np.ndarray | None,
                  samples: int | None) -> Iterator["DataParallel"]:
        """The caller's ``with dp.step():`` block inside the reducer's step."""
        reducer = self._reducer
        if reducer.step is not None:
            raise RuntimeError("dp.step() is already active: steps cannot nest")
        join = self.join_context
        if join is not None and join.enabled and join.joinables[0] is not self:
            raise RuntimeError("DataParallel must be the first joinable of its Join: "
                               "Join([dp, ...])")
        step = reducer.begin(Join.notify_join_context(self), micro_batches, samples)
        with reducer.agreeing_on_failures(step), _entered(step):
            reducer.prepare(unused)
            yield self
            reducer.finish(step)

    def mark_ready(self, index: int) -> None:
        """Gradient `index` is final for this step: its bucket may start reducing now.

        Call it during the backward pass to overlap communication with computation.
        Buckets start in bucket order on every rank, whatever the order of the calls.
        """
        if self._reducer.step is None:
            self._check_entered()
        self._reducer.mark_ready(index)

    def start_ready(self) -> None:
        """Before another joinable's collective (a SyncBatchNorm statistic in the backward
        pass): start every bucket that is ready, so that which buckets precede it is the same
        on every rank, whatever the timing."""
        self._reducer.start_ready()

    # -- Joinable -----------------------------------------------------------------------------

    def end_iteration(self) -> None:
        """Before each heartbeat, on every rank: the optimizer bound to ``dp.grads`` last, if
        it holds state, must be in the Join (``RuntimeError`` naming ``Join([dp, opt])``), and
        no ``dp.step()`` may have been called without ``with``."""
        self._check_entered()
        if self._reducer.update is None:  # with update=, it steps there, not in the Join
            self._place_check(self.join_context, self.grads.stateful_optimizer, self.grads,
                              must_join=True)

    def _brought_joinables(self, listed: list[Joinable]) -> list[Joinable]:
        """The JoinableComm this DataParallel holds for the SyncBatchNorm layers over its
        tensors that have no group, when `listed` holds no JoinableComm of the caller's."""
        return self._layers.brought(listed)

    def _made_into(self, join: Join) -> None:
        """`join` was made with this DataParallel: it must be the Join's only one, and the
        layers over its tensors that reduce through the Join's stream (SyncBatchNorm) check
        it, on every rank, before anything starts."""
        others = [j for j in join.joinables if isinstance(j, DataParallel) and j is not self]
        if others:
            raise ValueError(
                f"a Join holds at most one DataParallel, got {len(others) + 1}: the first one "
                f"leads the Join's iterations (its heartbeat), and another one's steps could "
                f"not run inside it; train every parameter through one DataParallel")
        self._layers.check(join)
        if join.elastic:
            self._reducer.keep()
        super()._made_into(join)

    def defers_requests(self) -> bool:
        """After a ``no_sync()`` step, until the next synchronising one: a stop or a periodic
        save then would lose the accumulated gradients, so the Join holds it back."""
        return self._reducer.unsynced

    # -- ElasticJoinable: an elastic Join's settle, the reducer's ---------------------------

    needs_step_owner = True  # its parameters change through the optimizer or update=

    def elastic_progress(self) -> int | None:
        """``update=`` runs completed when it owns the step (``update=``), else ``None``."""
        return self._reducer.elastic_progress()

    def elastic_state(self) -> list[Any]:
        """The parameters, the buffers as the last completed step left them, the counters."""
        return self._reducer.elastic_state()

    def elastic_restore(self) -> None:
        """The counters and the buffers of the settled step."""
        self._reducer.elastic_restore()

    def elastic_companions(self) -> list[Any]:
        """The object whose method ``update=`` is (an optimizer), else none."""
        return self._reducer.elastic_companions()

    def move_to(self, comm: MPI.Intracomm) -> None:
        """Work on `comm` from now on (and ``update=``'s library optimizer with it)."""
        super().move_to(comm)
        self._reducer.moved(comm)

    def replicated_arrays(self) -> list[Any]:
        """The parameters and buffers: the same on every rank."""
        return [*self.params, *self.buffers]

    def join_hook(self, *, divide_by_initial_world_size: bool = True,
                  **kwargs: Any) -> JoinHook:
        """The hook that shadows steps on a joined rank.

        Parameters
        ----------
        divide_by_initial_world_size : bool, default True
            Average over the world size (True) or over the ranks active in the step (False).
            The hook carries it; joined ranks tell active ones in the step control (with every
            rank active both divisors are the world size).
        """
        return self._reducer.join_hook(bool(divide_by_initial_world_size))
