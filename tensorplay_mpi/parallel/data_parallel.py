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
3. when the step synchronises: one ``Iallreduce(IN_PLACE, SUM)`` per bucket, in bucket order;
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
"""

from __future__ import annotations

import contextlib
import numbers
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from mpi4py import MPI

from ..algorithms.elastic import BufferSnapshot, update_owner
from ..algorithms.guarded_joinable import GuardedJoinable
from ..algorithms.join import Join, JoinHook
from ..comm import torch_cuda
from ..comm.buffers import check_disjoint, device_of, is_device_array
from ..comm.collectives import Work, iallreduce, ibcast
from ..comm.tensors import JOIN_CHECK, as_array, as_arrays, is_tensor, like
from .buckets import make_buckets
from .gradient_link import GradientViews, PlaceCheck, in_join
from .torch_grads import TorchGradients, check_unbound, frozen_mask

__all__ = ["DataParallel"]

_ENTERED: list["_Step"] = []  # the dp.step() blocks this process is inside, innermost last


def step_in_progress() -> tuple[int, int | None] | None:
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
def _entered(step: "_Step") -> Iterator[None]:
    """`step` in :data:`_ENTERED` while the caller's ``with dp.step():`` block runs."""
    _ENTERED.append(step)
    try:
        yield
    finally:
        _ENTERED.remove(step)


# The constructor's local checks: what one rank refuses, every rank learns before any broadcast.
def _check_arrays(given: Any, name: str, floating: bool) -> tuple[list[Any], list[Any]]:
    """The caller's arrays and tensors, and the arrays the library works on (torch tensors:
    NumPy views of their memory); raises if they cannot be trained in place."""
    if isinstance(given, np.ndarray) or is_device_array(given) or is_tensor(given):
        raise TypeError(f"{name}: pass a sequence of arrays (got one "
                        f"{type(given).__name__}: use [array])")
    given = list(given)
    arrays = as_arrays(given, name)
    for i, array in enumerate(arrays):
        if not (isinstance(array, np.ndarray) or is_device_array(array)):
            raise TypeError(f"{name}[{i}] must be a NumPy or CuPy array or a torch tensor, "
                            f"got {type(array).__name__}")
        if floating and array.dtype not in (np.float32, np.float64):
            raise TypeError(f"{name}[{i}] must be float32 or float64, got {array.dtype}")
        if array.dtype == object:
            raise TypeError(f"{name}[{i}] has dtype object, which MPI cannot send")
        if not array.flags.c_contiguous:
            raise ValueError(f"{name}[{i}] must be C-contiguous ({_contiguous_remedy(given[i])})")
        if not getattr(array.flags, "writeable", True):
            raise ValueError(f"{name}[{i}] is read-only: DataParallel writes it on every rank "
                             "(broadcasts from other ranks, in-place updates)")
    return given, arrays


def _contiguous_remedy(given: Any) -> str:
    """How to make `given` contiguous in place: a copy would train memory nobody reads."""
    if is_tensor(given):
        return ("a torch tensor: make the model's own tensor contiguous before DataParallel is "
                "built, `with torch.no_grad(): p.data = p.data.contiguous()`; passing "
                "p.contiguous() would train a copy the model never reads")
    return "use numpy.ascontiguousarray, and train the copy"


def _check_update(update: Any) -> Callable[[], Any] | None:
    if update is not None and not callable(update):
        raise TypeError(f"update must be a callable taking no argument (for example "
                        f"opt.step), got {type(update).__name__}")
    return update


def _one_device(arrays: list[Any]) -> str:
    devices = {device_of(a) for a in arrays}
    if len(devices) > 1:
        where = ", ".join(f"[{i}] on {device_of(a)}" for i, a in enumerate(arrays))
        raise ValueError(f"params and buffers must be on one device, got {where}")
    return devices.pop() if devices else "cpu"


def _check_rank(value: Any, name: str, size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int rank, got {value!r}")
    if not 0 <= int(value) < size:
        raise ValueError(f"{name} must be a rank in [0, {size}), got {value!r}")
    return int(value)


class _Step:
    """The state of one step on this rank, active or shadowing.

    ``syncs`` is this rank's wish until the step is resolved (the heartbeat's count known, the
    step control exchanged if needed), then the agreed value; ``works`` are the started bucket
    allreduces in bucket order, so ``len(works)`` is the cursor of the next bucket to start.
    """

    __slots__ = ("number", "heartbeat", "resolved", "deferred", "syncs", "root", "divisor",
                 "active", "samples", "per_sample", "ready", "unready", "works",
                 "micro_batches", "seen", "all_have", "all_used")

    def __init__(self, number: int, heartbeat: Work | None, syncs: bool,
                 params: int, bucket_sizes: list[int], micro_batches: int = 1,
                 samples: int | None = None) -> None:
        self.number = number
        self.heartbeat = heartbeat  # waited for at most once, where its count is first needed
        self.resolved = False
        self.deferred = False  # ranks have joined in a Join with a stream: one block at the end
        self.syncs = syncs
        self.root = -1  # the highest active rank, once resolved
        self.divisor = 0  # what a summed bucket is divided by, once resolved
        self.active = 0  # ranks active in the step, once resolved
        self.samples = samples  # this rank's samples, for a per-sample mean (dp.step(samples=))
        self.per_sample: bool | None = None  # the active ranks' choice, when the control told
        self.ready = np.zeros(params, dtype=bool)  # mark_ready flags per parameter
        self.unready = list(bucket_sizes)  # members not yet marked ready, per bucket
        self.works: list[Work] = []
        self.micro_batches = micro_batches  # backward passes per parameter before it is ready
        self.seen = np.zeros(params, dtype=np.int64) if micro_batches > 1 else None
        self.all_have = False  # every parameter has a gradient here (known at the step's end)
        self.all_used = True  # every bucketed parameter was used by some rank


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


class DataParallel(GuardedJoinable):
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
        C-contiguous float32 or float64 (one bucket set per dtype).  Buckets, zeroing and
        averaging stay on that device.  A torch parameter that requires gradients gets
        ``p.grad`` bound to its bucket view, so that ``loss.backward()`` writes there; the
        binding is repaired at each step (``model.zero_grad()`` unbinds it).
    comm : mpi4py.MPI.Intracomm, optional
        Defaults to ``MPI.COMM_WORLD``; see
        :class:`~tensorplay_mpi.algorithms.guarded_joinable.GuardedJoinable`.
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

    Raises
    ------
    TypeError
        On every rank, if a rank passed one array instead of a sequence, a non-array, integer
        or object params, or a `broadcast_from` that is not an int.
    ValueError
        On every rank, if a rank passed non-contiguous or read-only arrays, arrays on several
        devices, ``bucket_cap_mb <= 0``, a `broadcast_from` that is not a rank, or if ranks
        passed different shapes/dtypes, `bucket_cap_mb` or `broadcast_from`.

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
    ) -> None:
        super().__init__(comm, timeout)
        refused = None
        given: list[Any] = []
        frozen: list[bool] = []
        self._update: Callable[[], Any] | None = None
        try:
            given, self.params = _check_arrays(params, "params", floating=True)
            frozen = frozen_mask(given)
            check_unbound(given)
            self.buffers = _check_arrays(buffers, "buffers", floating=False)[1]
            self.device = _one_device(self.params + self.buffers)
            check_disjoint(params=self.params, buffers=self.buffers)
            if not bucket_cap_mb > 0:
                raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
            broadcast_from = _check_rank(broadcast_from, "broadcast_from", self.size)
            self._update = _check_update(update)
        except (TypeError, ValueError) as error:
            refused = error
        layout = ([(a.shape, a.dtype.str) for a in self.params],
                  [(a.shape, a.dtype.str) for a in self.buffers],
                  [i for i, f in enumerate(frozen) if f]) if refused is None else None
        self._check_arguments(refused, layout, "parameter or buffer shapes/dtypes, or frozen "
                              "parameters", f"params {layout and layout[0]}, buffers "
                              f"{layout and layout[1]} and frozen params {layout and layout[2]}",
                              broadcast_from=broadcast_from, bucket_cap_mb=bucket_cap_mb)
        self._buckets, self._bucket_of, views = make_buckets(self.params, bucket_cap_mb * 2**20,
                                                             frozen)
        self.grads = GradientViews([like(p, v) for p, v in zip(given, views)], self)
        checks = (getattr(p, JOIN_CHECK, None) for p in given)
        self._join_checks = list({id(c): c for c in checks if c is not None}.values())
        self._place_check = PlaceCheck()
        self._broadcast(self.params + self.buffers, broadcast_from, "initial broadcast")
        self._overlap = overlap
        self._torch = TorchGradients(given, self.grads, DataParallel._accumulated, self)
        self.used = ~np.asarray(frozen, dtype=bool)
        self._has = self._torch.has  # per parameter: this rank has a gradient since the last sync
        self._manual = np.flatnonzero(~self._torch.bound & self.used)  # arrays, hand-trained
        self._has[self._manual] = False  # each step marks them used unless told otherwise
        torch_params = [(i, p, bool(p.requires_grad)) for i, p in enumerate(given)
                        if is_tensor(p)]
        self._requires = torch_params  # requires_grad at construction, checked at each step

        self._sync = True  # False inside no_sync()
        self._unsynced = False  # the last step (or its shadow) did not synchronise
        self.samples = 0  # the active ranks' samples in the last step with samples=
        self._unentered: _MustEnter | None = None  # a step() or no_sync() never entered
        self._steps = 0
        self._updates = 0  # update= runs completed (an elastic Join's settle)
        self._completed = 0  # the number of the last step completed
        self._counters = np.zeros(2, dtype=np.int64)  # what an elastic settle broadcasts
        self._kept = BufferSnapshot(self.buffers)  # and the buffers of the last completed step
        self._step: _Step | None = None  # the step in progress
        self._counts = np.zeros(5, dtype=np.int64)  # the step control's buffers
        self._highest = np.zeros(1, dtype=np.int64)

    @property
    def steps(self) -> int:
        """Steps taken: this rank's ``dp.step()`` blocks plus the steps it shadowed once
        joined, so the same on every rank at every iteration boundary (inside a Join's
        ``on_save``, where a joined rank runs no loop of its own), across Joins.  A step
        counter for saves and per-step schedules; set it after a resume
        (``dp.steps = resumed.step``)."""
        return self._steps

    @steps.setter
    def steps(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(f"steps must be an int >= 0, got {value!r}")
        self._steps = int(value)

    def _broadcast(self, arrays: list[np.ndarray], root: int, what: str) -> None:
        self._wait_all([ibcast(self.comm, a, root, f"{what} {i + 1} of {len(arrays)}")
                        for i, a in enumerate(arrays)])

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
        if self._step is not None:
            raise RuntimeError("no_sync() must be entered outside a step, around dp.step()")
        join = self.join_context
        if join is not None and join.elastic:
            raise RuntimeError(
                "no_sync() inside an elastic Join: a lost rank's accumulated gradients could "
                "not be settled (the samples of an interrupted accumulation would be counted "
                "wrong); accumulate with dp.step(micro_batches=...) or leave elastic off")
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def zero_grad(self) -> None:
        """Set every gradient to zero (for example before accumulating with no_sync)."""
        torch_cuda.take()  # torch CUDA gradients: filled after torch's last reads
        for bucket in self._buckets:
            bucket.flat.fill(0)
        torch_cuda.hand_back()  # and backward() accumulates after the fill

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
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, numbers.Integral):
            raise TypeError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
        unused = self._check_unused(unused) if len(unused) else None
        if samples is not None and (isinstance(samples, bool)
                                    or not isinstance(samples, numbers.Integral)):
            raise TypeError(f"samples must be an int >= 0 or None, got {samples!r}")
        if samples is not None and samples < 0:
            raise ValueError(f"samples must be an int >= 0 or None, got {samples!r}")
        return _MustEnter(self, self._run_step(int(micro_batches), unused,
                                               None if samples is None else int(samples)),
                          "step")

    def _check_unused(self, unused: Sequence[int]) -> np.ndarray:
        indices = np.asarray(unused)
        if indices.dtype.kind not in "iu" or indices.ndim != 1:
            raise TypeError(f"unused must be a sequence of int parameter indices, got {unused!r}")
        for i in indices.tolist():
            if not 0 <= i < len(self.params):
                raise IndexError(f"unused: parameter index {i} out of range "
                                 f"[0, {len(self.params)})")
            if self._torch.bound[i]:
                raise ValueError(f"unused: parameter {i} is a torch parameter that requires "
                                 "gradients; whether it is used is read from autograd (its "
                                 "p.grad), not passed")
        return indices

    def _check_frozen(self) -> None:
        for i, p, requires in self._requires:
            if bool(p.requires_grad) != requires:
                state = "frozen" if requires else "unfrozen"
                raise RuntimeError(
                    f"params[{i}] was {state} (requires_grad set to {not requires}) after "
                    "DataParallel was built; DataParallel reads requires_grad once, as DDP: "
                    "build a new DataParallel after changing which parameters train")

    @contextlib.contextmanager
    def _run_step(self, micro_batches: int = 1, unused: np.ndarray | None = None,
                  samples: int | None = None) -> Iterator["DataParallel"]:
        if self._step is not None:
            raise RuntimeError("dp.step() is already active: steps cannot nest")
        join = self.join_context
        if join is not None and join.enabled and join.joinables[0] is not self:
            raise RuntimeError("DataParallel must be the first joinable of its Join: "
                               "Join([dp, ...])")
        heartbeat = Join.notify_join_context(self)
        self._steps += 1
        self._step = step = _Step(self._steps, heartbeat, self._sync, len(self.params),
                                  [len(b.members) for b in self._buckets], micro_batches,
                                  samples)
        with self._settling_failures(step), _entered(step):
            if self._requires:
                self._check_frozen()
            if self._manual.size:
                self._mark_manual(unused)
            if self._torch:
                self._torch.point_grads_at_buckets(range(len(self.params)))
            yield self
            if self._torch:  # what no hook saw: model.zero_grad() inside the step, say
                self._torch.point_grads_at_buckets(np.flatnonzero(~step.ready).tolist())
            self._finish_buckets(step)
            self._broadcast_buffers(step)
            self._after_step(step)

    def _mark_manual(self, unused: np.ndarray | None) -> None:
        """Array parameters are used in this step unless listed in `unused`."""
        if unused is None:
            self._has[self._manual] = True
        else:
            mask = np.zeros(len(self.params), dtype=bool)
            mask[self._manual] = True
            mask[unused] = False
            self._has[mask] = True

    def _after_step(self, step: _Step, shadow: bool = False) -> None:
        """On every rank, active or joined: publish which gradients exist, then ``update``.

        With every parameter used, an active rank's ``p.grad`` are its bucket views already
        (bound at the step's end), so only a joined rank publishes."""
        torch_cuda.hand_back()  # torch CUDA gradients: torch's stream after the averaging
        self._unsynced = not step.syncs  # agreed: the same on every rank
        if not step.syncs:
            if self._torch:
                self._torch.keep_local()
            return
        if step.all_used:
            self._has.fill(True)
            if shadow and self._torch:
                self._torch.publish(self.used)
        elif self._torch:
            self._torch.publish(self.used)
        if self._manual.size:
            self._has[self._manual] = False
        if self._update is not None:
            join = self.join_context  # every rank runs it here: operations in it are plain
            with join.everywhere() if join is not None else contextlib.nullcontext():
                self._update()
            self._updates += 1

    def _accumulated(self, index: int) -> None:
        """The post-accumulate-grad hook of torch parameter `index`: bind, then (overlap) mark
        ready after the step's last micro-batch."""
        self._torch.point_grads_at_buckets((index,))
        self._has[index] = True
        step = self._step
        if not self._overlap or step is None or (step.ready[index] and not step.syncs):
            return
        if step.seen is not None:
            step.seen[index] += 1
            if step.seen[index] < step.micro_batches:
                return
        if step.ready[index]:
            raise RuntimeError(
                f"parameter {index} got more gradients in one dp.step() than its micro_batches "
                f"({step.micro_batches}): its bucket may already be reducing. To accumulate K "
                "micro-batches, enter the step as `with dp.step(micro_batches=K):` and call "
                "backward K times inside it")
        self.mark_ready(index)

    def mark_ready(self, index: int) -> None:
        """Gradient `index` is final for this step: its bucket may start reducing now.

        Call it during the backward pass to overlap communication with computation.
        Buckets start in bucket order on every rank, whatever the order of the calls.
        """
        step = self._step
        if step is None:
            self._check_entered()
            raise RuntimeError("mark_ready() is only valid inside dp.step()")
        if not 0 <= index < len(self.params):
            raise IndexError(f"parameter index {index} out of range [0, {len(self.params)})")
        if step.ready[index]:
            raise RuntimeError(f"mark_ready({index}) was already called in this step")
        if self._bucket_of[index] < 0:
            raise ValueError(f"mark_ready({index}): parameter {index} is frozen (it has no "
                             "bucket)")
        step.ready[index] = True
        step.unready[self._bucket_of[index]] -= 1
        if step.syncs:
            self._start_ready_buckets(step)

    def _start_ready_buckets(self, step: _Step, one_at_a_time: bool = True) -> None:
        """Start the next buckets whose gradients are all ready, one in flight at a time.

        MPI progresses a nonblocking collective only inside MPI calls: this test of the
        bucket in flight, made at every mark_ready(), is where the overlap happens.  One
        bucket at a time: concurrent large allreduces run slower than back-to-back ones
        (``make bench``).  Not `one_at_a_time`: every ready bucket, now (:meth:`start_ready`).
        """
        works = step.works
        while len(works) < len(self._buckets) and step.unready[len(works)] == 0:
            if one_at_a_time and works and not works[-1].is_completed():
                return
            self._resolve(step)  # the first bucket needs the heartbeat's count (and agreed syncs)
            if step.deferred:
                return
            self._start_bucket(step, len(works))

    def start_ready(self) -> None:
        """Before another joinable's collective (a SyncBatchNorm statistic in the backward
        pass): start every bucket that is ready, so that which buckets precede it is the same
        on every rank, whatever the timing."""
        step = self._step
        if step is not None and step.syncs:
            self._start_ready_buckets(step, one_at_a_time=False)

    # -- one step, on the active and the joined side ------------------------------------------

    def _resolve(self, step: _Step) -> None:
        """Learn who is active in `step` where it is first needed (module docstring, 1-2).

        Waits for the heartbeat; when a rank has joined, exchanges the step control, or, in a
        Join with a stream (a JoinableComm), defers it to the step's end, where the step's
        collectives are announced as one block.  Once per step.
        """
        if step.resolved:
            return
        step.resolved = True
        active = self.size if step.heartbeat is None else self._wait(step.heartbeat)
        step.active = active
        if active == self.size:
            step.root, step.divisor = self.size - 1, self.size
        elif self.join_context is not None and self.join_context.stream is not None:
            step.deferred = True
        else:
            self._exchange_control(step, None)

    def _broadcast_buffers(self, step: _Step) -> None:
        """The buffers of the step's highest active rank, on every rank, at the step's end:
        every rank, joined or not, then holds what a save must write (module docstring, 3)."""
        if self.buffers:
            self._broadcast(self.buffers, step.root, "buffer broadcast")

    def _exchange_control(self, step: _Step, divide_by_world: bool | None) -> None:
        """The step control; `divide_by_world` is a joined rank's Join option, None if active."""
        counts, highest = self._counts, self._highest
        if divide_by_world is None:
            counts[:] = (1, int(step.syncs), 0, 0, int(step.samples is not None))
            highest[0] = self.rank
        else:
            counts[:] = (0, 0, int(divide_by_world), int(not divide_by_world), 0)
            highest[0] = -1
        what = f"step control (step {step.number})"
        self._wait_all([iallreduce(self.comm, MPI.IN_PLACE, counts, MPI.SUM, f"{what}: counts"),
                        iallreduce(self.comm, MPI.IN_PLACE, highest, MPI.MAX,
                                   f"{what}: highest active rank")])
        active, syncing, by_world, by_active, per_sample = counts.tolist()
        if per_sample not in (0, active):
            raise RuntimeError(
                f"{per_sample} of {active} active ranks passed samples= to dp.step() in step "
                f"{step.number}: every active rank must pass it for the same steps")
        step.per_sample = per_sample > 0
        if syncing not in (0, active):
            raise RuntimeError(
                f"{syncing} of {active} active ranks synchronise gradients in this step: every "
                "active rank must use dp.no_sync() for the same steps")
        optimizer = self.grads.stateful_optimizer
        join = self.join_context
        if not syncing and optimizer is not None and join is not None \
                and in_join(join, optimizer):
            raise RuntimeError(
                f"dp.no_sync() while a rank has joined, with {type(optimizer).__name__} in the "
                "Join: a joined rank steps it every round, so its state would diverge. "
                "Accumulate K micro-batches inside one step, `with dp.step(micro_batches=K):` "
                "with K backward passes")
        if by_world and by_active:
            raise ValueError(
                f"joined ranks passed different divide_by_initial_world_size to their Join "
                f"({by_world} True, {by_active} False): pass the same on every rank")
        step.syncs, step.root, step.active = syncing > 0, int(highest[0]), active
        step.divisor = active if by_active else self.size

    def _start_bucket(self, step: _Step, k: int, shadow: bool = False) -> None:
        torch_cuda.take()  # torch CUDA gradients: the kernels below after torch's last writes
        bucket = self._buckets[k]
        if not shadow:
            if step.unready[k] == 0 or step.all_have:  # marked ready: it has its gradient
                bucket.flags.fill(1)
            else:
                self._set_flags(bucket)
            if step.samples is not None:  # this rank's mean, weighted by its samples
                bucket.grads *= step.samples  # (the slots are zero otherwise: see _divisor)
                bucket.samples[0], bucket.samples[1] = step.samples, 1
        if shadow:  # a joined rank sends zeros, in place as the active ranks (see iallreduce)
            bucket.flat.fill(0)
        step.works.append(iallreduce(
            self.comm, MPI.IN_PLACE, bucket.flat, MPI.SUM,
            f"bucket {k + 1} of {len(self._buckets)} (step {step.number})"))

    def _set_flags(self, bucket: Any) -> None:
        """This rank's "used" flags of `bucket` (some member has no gradient here, or none
        was marked ready); a gradient it has not produced is zero."""
        has = self._has[bucket.index]
        bucket.write_flags(has)
        if not has.all():
            for i in bucket.index[~has].tolist():
                as_array(self.grads[i])[...] = 0

    def _finish_buckets(self, step: _Step, shadow: bool = False) -> None:
        """Start the buckets not started yet (a joined rank: all, sending zeros), then average;
        read which parameters some rank used."""
        self._resolve(step)
        if step.deferred:  # the step's collectives as one announced block
            self.join_context.announce(self)  # type: ignore[union-attr]
            step.deferred = False
            self._exchange_control(step, None)
        if not step.syncs:
            return
        step.all_have = not shadow and bool(self._has.all())
        works, last = step.works, len(self._buckets) - 1
        for k, bucket in enumerate(self._buckets):
            if len(works) == k:
                self._start_bucket(step, k, shadow)
            self._wait(works[k])
            if len(works) == k + 1 and k < last:
                self._start_bucket(step, k + 1, shadow)  # posted before this bucket's division
            bucket.divide(self._divisor(step, bucket))
            if bucket.flags.all():  # every member used by some rank: the usual case (on a
                if not bucket.all_used:  # device, read there: no copy to the host)
                    self.used[bucket.index] = bucket.all_used = True
            else:
                self.used[bucket.index] = bucket.read_flags() > 0
                bucket.all_used = step.all_used = False

    def _divisor(self, step: _Step, bucket: Any) -> float:
        """What a summed bucket is divided by: the step's divisor, or the active ranks'
        samples when they average per sample, read from the bucket's sample slots.  With a
        rank joined the step control said which; with every rank active each rank reads the
        slots (on a device only where it passed ``samples``: no copy to the host otherwise, so
        a rank without it meets another's mismatch as a PeerFailureError)."""
        if step.per_sample is False or (step.per_sample is None and step.samples is None
                                         and type(bucket.samples) is not np.ndarray):
            return step.divisor
        samples, ranks = bucket.read_samples()
        if step.per_sample is None and ranks == 0:
            return step.divisor
        if step.per_sample is None and ranks != step.active:
            raise RuntimeError(
                f"{int(ranks)} of {step.active} active ranks passed samples= to dp.step() in "
                f"step {step.number}: every active rank must pass it for the same steps")
        self.samples = int(samples)
        bucket.samples.fill(0)  # so that the next step sends zeros unless it passes samples
        return max(samples, 1.0)

    @contextlib.contextmanager
    def _settling_failures(self, step: _Step) -> Iterator[None]:
        """Around one step (active or shadowed): an exception is settled (:meth:`_recover`)
        before it propagates; the step ends either way."""
        try:
            yield
        except BaseException as error:
            self._recover(step, error)
            raise
        else:
            self._completed = step.number
            if self.join_context is not None and self.join_context.elastic:
                self._kept.keep()  # what a redone step starts from (an elastic settle)
        finally:
            self._step = None

    def _recover(self, step: _Step, error: BaseException) -> None:
        """A step's failure path: agree with every rank, complete what the furthest one started.

        When every rank failed on its own the communicator is intact, but the ranks may have
        started different numbers of buckets (``mark_ready`` overlap): each starts the ones it
        lacks (their content no longer matters) and waits for all of them.
        """
        verdict = self._guard.settle(error, progress=len(step.works))
        if verdict.intact:
            while len(step.works) < verdict.progress:
                self._start_bucket(step, len(step.works))
            self._wait_all(step.works)
            for bucket in self._buckets:  # no step reads them: the next sends zeros
                bucket.samples.fill(0)

    def _shadow_step(self, divide_by_world: bool) -> None:
        """One active step as a joined rank takes part in it (the hook's main_hook)."""
        self._steps += 1
        self._step = step = _Step(self._steps, None, False, len(self.params), [])
        step.resolved = True
        with self._settling_failures(step):
            self._exchange_control(step, divide_by_world)
            self._finish_buckets(step, shadow=True)
            self._broadcast_buffers(step)
            self._after_step(step, shadow=True)

    def _final_broadcast(self, is_last_joiner: bool) -> None:
        """Broadcast from the highest last joiner: buffers always, params unless all are last.

        Buffers are updated locally in every step, so they differ after the last one; params
        differ only on ranks that joined early (they skipped updates).
        """
        flags = np.array([self.rank if is_last_joiner else -1, int(not is_last_joiner)],
                         dtype=np.int64)
        self._wait(iallreduce(self.comm, MPI.IN_PLACE, flags, MPI.MAX, "last joiner"))
        stale = self.params + self.buffers if flags[1] else self.buffers
        self._broadcast(stale, int(flags[0]), "final broadcast")

    # -- Joinable -----------------------------------------------------------------------------

    def end_iteration(self) -> None:
        """Before each heartbeat, on every rank: the optimizer bound to ``dp.grads`` last, if
        it holds state, must be in the Join (``RuntimeError`` naming ``Join([dp, opt])``), and
        no ``dp.step()`` may have been called without ``with``."""
        self._check_entered()
        if self._update is None:  # with update=, the optimizer steps there, not in the Join
            self._place_check(self.join_context, self.grads.stateful_optimizer, self.grads,
                              must_join=True)

    def _made_into(self, join: Join) -> None:
        """`join` was made with this DataParallel: the layers over its parameters that must
        reduce through the Join's stream (SyncBatchNorm) check it, on every rank, before
        anything starts."""
        for check in self._join_checks:
            check(join)
        if join.elastic:
            self._kept.keep()
        super()._made_into(join)

    def defers_requests(self) -> bool:
        """After a ``no_sync()`` step, until the next synchronising one: a stop or a periodic
        save then would lose the accumulated gradients, so the Join holds it back."""
        return self._unsynced

    # -- an elastic Join's settle (tensorplay_mpi.algorithms.elastic) ------------------------

    _elastic = True
    _elastic_needs_owner = True  # its parameters change through the optimizer or update=

    def _elastic_progress(self) -> int | None:
        """``update=`` runs completed: the step's owner with ``update=``; else None."""
        return None if self._update is None else self._updates

    def _elastic_state(self) -> list[Any]:
        """The parameters, the buffers as the last completed step left them and the counts of
        completed steps and updates."""
        self._counters[:] = self._completed, self._updates
        return self.params + self._kept.arrays() + [self._counters]

    def _elastic_restore(self) -> None:
        """Steps are those completed (an interrupted one is dropped, or completed from another
        rank), and so are the buffers."""
        self._steps = self._completed = int(self._counters[0])
        self._updates = int(self._counters[1])
        self._kept.restore()

    def _elastic_companions(self) -> list[Any]:
        """The object whose method ``update=`` is (an optimizer), settled with this one."""
        return [] if self._update is None else [update_owner(self._update)]

    def _move_to(self, comm: MPI.Intracomm) -> None:
        super()._move_to(comm)
        mover = getattr(getattr(self._update, "__self__", None), "_move_to", None)
        if callable(mover):  # a library optimizer stepped by update=
            mover(comm)
        self._step, self._unsynced = None, False
        for bucket in self._buckets:
            bucket.samples.fill(0)

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
        return _DataParallelHook(self, bool(divide_by_initial_world_size))


class _DataParallelHook(JoinHook):
    def __init__(self, dp: DataParallel, divide_by_initial_world_size: bool) -> None:
        self.dp = dp
        self.divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        """Shadow one active step; the averaged gradients land in this rank's ``dp.grads``."""
        self.dp._shadow_step(self.divide_by_initial_world_size)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Make every rank's params and buffers those of the highest last joiner."""
        self.dp._final_broadcast(is_last_joiner)
