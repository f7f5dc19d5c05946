"""DataParallel's reducer: the step's wire, its buckets, a joined rank's shadow, its recovery.

:class:`~tensorplay_mpi.DataParallel` is the user's object (arguments, ``dp.step()``, the
Joinable); the :class:`Reducer` it owns moves the gradients, as torch's DDP is a Module over a
Reducer.  It issues the wire schedule of a step that :mod:`.data_parallel`'s docstring gives
(numbered 1-4 there, and here), and a joined rank's hook (:meth:`Reducer.join_hook`) shadows
it.  Not exported: its interface may change with DataParallel's.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Any, Iterator, cast

import numpy as np
from mpi4py import MPI

from ..algorithms._elastic import BufferSnapshot, update_owner
from ..algorithms.join import ElasticJoinable, JoinHook
from ..comm import _torch_cuda as torch_cuda
from ..comm._collectives import Work, iallreduce, ibcast
from ..comm._tensors import as_array, is_tensor, like
from ._buckets import make_buckets
from ._checks import (Arguments, check_control, check_per_sample, check_ready,
                      check_requires_grad)
from ._gradient_link import GradientViews, in_join
from ._torch_grads import TorchGradients

if TYPE_CHECKING:
    from ._data_parallel import DataParallel


class Step:
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


class Reducer:
    """The buckets of one DataParallel and every collective of its steps.

    Collective over the DataParallel's communicator: it broadcasts the parameters and buffers
    from ``args.broadcast_from``.

    Parameters
    ----------
    owner : DataParallel
        Held weakly (it holds the reducer): its communicator, deadline and Join are the
        reducer's; ``owner.samples`` is written here.
    args : Arguments
        The checked arguments (:func:`.checks.check_construction`).
    cap_bytes : float
        The largest bucket.
    overlap : bool
        Whether a torch parameter's post-accumulate-grad hook marks it ready.

    Attributes
    ----------
    grads, used, steps
        ``dp.grads``, ``dp.used`` (written in place) and ``dp.steps``.
    step : Step or None
        The step in progress.
    """

    def __init__(self, owner: "DataParallel", args: Arguments, cap_bytes: float,
                 overlap: bool) -> None:
        self._owner = weakref.ref(owner)
        self.params, self.buffers, self.update = args.params, args.buffers, args.update
        self._buckets, self._bucket_of, views = make_buckets(self.params, cap_bytes, args.frozen,
                                                             args.compress)
        self.grads = GradientViews([like(p, v) for p, v in zip(args.given, views)], owner)
        self.broadcast(self.params + self.buffers, args.broadcast_from, "initial broadcast")
        self._overlap = overlap
        self._torch = TorchGradients(args.given, self.grads, Reducer._accumulated, self)
        self.bound = self._torch.bound  # per parameter: autograd tells whether it is used
        self.used = ~np.asarray(args.frozen, dtype=bool)
        self._has = self._torch.has  # per parameter: this rank has a gradient since the last sync
        self._manual = np.flatnonzero(~self.bound & self.used)  # arrays, hand-trained
        self._has[self._manual] = False  # each step marks them used unless told otherwise
        self._requires = [(i, p, bool(p.requires_grad)) for i, p in enumerate(args.given)
                          if is_tensor(p)]  # requires_grad at construction, checked each step
        self.sync = True  # False inside no_sync()
        self.unsynced = False  # the last step (or its shadow) did not synchronise
        self.steps = 0
        self._updates = 0  # update= runs completed (an elastic Join's settle)
        self._completed = 0  # the number of the last step completed
        self._counters = np.zeros(2, dtype=np.int64)  # what an elastic settle broadcasts
        self._kept = BufferSnapshot(self.buffers)  # and the buffers of the last completed step
        self.step: Step | None = None
        self._counts = np.zeros(5, dtype=np.int64)  # the step control's buffers
        self._highest = np.zeros(1, dtype=np.int64)

    @property
    def _dp(self) -> "DataParallel":
        """The owner: alive while its reducer is used (it holds the reducer)."""
        return cast("DataParallel", self._owner())

    def broadcast(self, arrays: list[Any], root: int, what: str) -> None:
        """Broadcast `arrays` from `root`, each as one ``Ibcast``."""
        dp = self._dp
        dp._wait_all([ibcast(dp.comm, a, root, f"{what} {i + 1} of {len(arrays)}")
                      for i, a in enumerate(arrays)])

    def zero_grads(self) -> None:
        """Every gradient zero, between torch's kernels (``dp.zero_grad()``)."""
        with torch_cuda.handed():  # filled after torch's last reads, and backward() after it
            for bucket in self._buckets:
                bucket.zero()

    # -- the step of an active rank -----------------------------------------------------------

    def begin(self, heartbeat: Work | None, micro_batches: int, samples: int | None) -> Step:
        """Count a step and make it the one in progress; `heartbeat` is its Join's."""
        self.steps += 1
        self.step = Step(self.steps, heartbeat, self.sync, len(self.params),
                         [len(b.members) for b in self._buckets], micro_batches, samples)
        return self.step

    def prepare(self, unused: np.ndarray | None) -> None:
        """At the step's start: check ``requires_grad``, mark the arrays used (but `unused`),
        bind every ``p.grad`` to its bucket view."""
        if self._requires:
            check_requires_grad(self._requires)
        if self._manual.size:
            self._mark_manual(unused)
        if self._torch:
            self._torch.point_grads_at_buckets(range(len(self.params)))

    def finish(self, step: Step) -> None:
        """At the step's end: bind what no hook saw, average, broadcast the buffers, update."""
        if self._torch:  # what no hook saw: model.zero_grad() inside the step, say
            self._torch.point_grads_at_buckets(np.flatnonzero(~step.ready).tolist())
        with torch_cuda.handed():  # the kernels after torch's writes, torch's after ours
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

    def _accumulated(self, index: int) -> None:
        """The post-accumulate-grad hook of torch parameter `index`: bind, then (overlap) mark
        ready after the step's last micro-batch."""
        self._torch.point_grads_at_buckets((index,))
        self._has[index] = True
        step = self.step
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
        """``dp.mark_ready(index)`` inside a step: start the buckets that are ready."""
        step = self.step
        if step is None:
            raise RuntimeError("mark_ready() is only valid inside dp.step()")
        check_ready(index, step.ready, self._bucket_of)
        step.ready[index] = True
        step.unready[self._bucket_of[index]] -= 1
        if step.syncs:
            self._start_ready_buckets(step)

    def _start_ready_buckets(self, step: Step, one_at_a_time: bool = True) -> None:
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
        """``dp.start_ready()``: start every bucket that is ready, now."""
        step = self.step
        if step is not None and step.syncs:
            self._start_ready_buckets(step, one_at_a_time=False)

    # -- one step, on the active and the joined side ------------------------------------------

    def _resolve(self, step: Step) -> None:
        """Learn who is active in `step` where it is first needed (the schedule, 1-2).

        Waits for the heartbeat; when a rank has joined, exchanges the step control, or, in a
        Join with a stream (a JoinableComm), defers it to the step's end, where the step's
        collectives are announced as one block.  Once per step.
        """
        if step.resolved:
            return
        step.resolved = True
        dp = self._dp
        active = dp.size if step.heartbeat is None else dp._wait(step.heartbeat)
        step.active = active
        if active == dp.size:
            step.root, step.divisor = dp.size - 1, dp.size
        elif dp.join_context is not None and dp.join_context.stream is not None:
            step.deferred = True
        else:
            self._exchange_control(step, None)

    def _broadcast_buffers(self, step: Step) -> None:
        """The buffers of the step's highest active rank, on every rank, at the step's end:
        every rank, joined or not, then holds what a save must write (the schedule, 4)."""
        if self.buffers:
            self.broadcast(self.buffers, step.root, "buffer broadcast")

    def _exchange_control(self, step: Step, divide_by_world: bool | None) -> None:
        """The step control; `divide_by_world` is a joined rank's Join option, None if active."""
        dp, counts, highest = self._dp, self._counts, self._highest
        if divide_by_world is None:
            counts[:] = (1, int(step.syncs), 0, 0, int(step.samples is not None))
            highest[0] = dp.rank
        else:
            counts[:] = (0, 0, int(divide_by_world), int(not divide_by_world), 0)
            highest[0] = -1
        what = f"step control (step {step.number})"
        dp._wait_all([iallreduce(dp.comm, MPI.IN_PLACE, counts, MPI.SUM, f"{what}: counts"),
                      iallreduce(dp.comm, MPI.IN_PLACE, highest, MPI.MAX,
                                 f"{what}: highest active rank")])
        active, syncing, by_world, by_active, per_sample = sums = counts.tolist()
        check_control(step.number, sums, None if syncing else self._joined_optimizer())
        step.per_sample = per_sample > 0
        step.syncs, step.root, step.active = syncing > 0, int(highest[0]), active
        step.divisor = active if by_active else dp.size

    def _joined_optimizer(self) -> Any:
        """The stateful optimizer bound to ``dp.grads``, if it is in the Join, else None."""
        optimizer, join = self.grads.stateful_optimizer, self._dp.join_context
        in_the_join = optimizer is not None and join is not None and in_join(join, optimizer)
        return optimizer if in_the_join else None

    def _start_bucket(self, step: Step, k: int, shadow: bool = False) -> None:
        torch_cuda.take()  # torch CUDA gradients: the kernels below after torch's last writes
        bucket = self._buckets[k]
        if not shadow:
            if step.unready[k] == 0 or step.all_have:  # marked ready: it has its gradient
                bucket.flags.fill(1)
            else:
                self._set_flags(bucket)
            bucket.pack()
            if step.samples is not None:  # this rank's mean, weighted by its samples
                bucket.grads *= step.samples  # (the slots are zero otherwise: see _divisor)
                bucket.samples[0], bucket.samples[1] = step.samples, 1
        if shadow:  # a joined rank sends zeros, in place as the active ranks (see iallreduce)
            bucket.flat.fill(0)
        wire, op = bucket.flat, MPI.SUM
        if bucket.compression is not None:  # divided first, as DDP's compression hooks
            bucket.divide(step.divisor or 1)  # (unresolved on a failure path: no matter)
            wire, op = bucket.compression.compress(), bucket.compression.op
        step.works.append(iallreduce(
            self._dp.comm, MPI.IN_PLACE, wire, op,
            f"bucket {k + 1} of {len(self._buckets)} (step {step.number})"))

    def _set_flags(self, bucket: Any) -> None:
        """This rank's "used" flags of `bucket` (some member has no gradient here, or none
        was marked ready); a gradient it has not produced is zero."""
        has = self._has[bucket.index]
        bucket.write_flags(has)
        if not has.all():
            for i in bucket.index[~has].tolist():
                as_array(self.grads[i], bits=True)[...] = 0

    def _finish_buckets(self, step: Step, shadow: bool = False) -> None:
        """Start the buckets not started yet (a joined rank: all, sending zeros), then average;
        read which parameters some rank used."""
        self._resolve(step)
        dp = self._dp
        join = dp.join_context
        if step.deferred and join is not None:  # the step's collectives as one announced block
            join.announce(dp)
            step.deferred = False
            self._exchange_control(step, None)
        if not step.syncs:
            return
        step.all_have = not shadow and bool(self._has.all())
        works, last = step.works, len(self._buckets) - 1
        for k, bucket in enumerate(self._buckets):
            if len(works) == k:
                self._start_bucket(step, k, shadow)
            dp._wait(works[k])
            if len(works) == k + 1 and k < last:
                self._start_bucket(step, k + 1, shadow)  # posted before this bucket's division
            if bucket.compression is None:
                bucket.divide(self._divisor(step, bucket))
            else:
                bucket.compression.decompress()
            bucket.unpack()
            if bucket.flags.all():  # every member used by some rank: the usual case (on a
                if not bucket.all_used:  # device, read there: no copy to the host)
                    self.used[bucket.index] = bucket.all_used = True
            else:
                self.used[bucket.index] = bucket.read_flags() > 0
                bucket.all_used = step.all_used = False

    def _divisor(self, step: Step, bucket: Any) -> float:
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
        if step.per_sample is None:
            check_per_sample(int(ranks), step.active, step.number)
        self._dp.samples = int(samples)
        bucket.samples.fill(0)  # so that the next step sends zeros unless it passes samples
        return max(samples, 1.0)

    def _after_step(self, step: Step, shadow: bool = False) -> None:
        """On every rank, active or joined: publish which gradients exist, then ``update``.

        With every parameter used, an active rank's ``p.grad`` are its bucket views already
        (bound at the step's end), so only a joined rank publishes."""
        self.unsynced = not step.syncs  # agreed: the same on every rank
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
        if self.update is not None:
            join = self._dp.join_context  # every rank runs it here: operations in it are plain
            with join.everywhere() if join is not None else contextlib.nullcontext():
                self.update()
            self._updates += 1

    @contextlib.contextmanager
    def agreeing_on_failures(self, step: Step) -> Iterator[None]:
        """Around one step (active or shadowed): an exception is agreed on (:meth:`_recover`)
        before it propagates; the step ends either way."""
        try:
            yield
        except BaseException as error:
            self._recover(step, error)
            raise
        else:
            self._completed = step.number
            join = self._dp.join_context
            if join is not None and join.elastic:
                self._kept.keep()  # what a redone step starts from (an elastic settle)
        finally:
            self.step = None

    def _recover(self, step: Step, error: BaseException) -> None:
        """A step's failure path: agree with every rank, complete what the furthest one started.

        When every rank failed on its own the communicator is intact, but the ranks may have
        started different numbers of buckets (``mark_ready`` overlap): each starts the ones it
        lacks (their content no longer matters) and waits for all of them.
        """
        dp = self._dp
        verdict = dp._guard.agree_on_failure(error, caller_completes=len(step.works))
        if verdict.intact:
            while len(step.works) < verdict.caller_completes:
                self._start_bucket(step, len(step.works))
            dp._wait_all(step.works)
            for bucket in self._buckets:  # no step reads them: the next sends zeros
                bucket.samples.fill(0)

    def shadow_step(self, divide_by_world: bool) -> None:
        """One active step as a joined rank takes part in it (the hook's main_hook)."""
        self.steps += 1
        self.step = step = Step(self.steps, None, False, len(self.params), [])
        step.resolved = True
        with self.agreeing_on_failures(step):
            with torch_cuda.handed():  # the kernels after torch's writes, torch's after ours
                self._exchange_control(step, divide_by_world)
                self._finish_buckets(step, shadow=True)
                self._broadcast_buffers(step)
            self._after_step(step, shadow=True)

    def final_broadcast(self, is_last_joiner: bool) -> None:
        """Broadcast from the highest last joiner: buffers always, params unless all are last.

        Buffers are updated locally in every step, so they differ after the last one; params
        differ only on ranks that joined early (they skipped updates).
        """
        dp = self._dp
        flags = np.array([dp.rank if is_last_joiner else -1, int(not is_last_joiner)],
                         dtype=np.int64)
        dp._wait(iallreduce(dp.comm, MPI.IN_PLACE, flags, MPI.MAX, "last joiner"))
        stale = self.params + self.buffers if flags[1] else self.buffers
        self.broadcast(stale, int(flags[0]), "final broadcast")

    # -- an elastic Join's settle (tensorplay_mpi.algorithms._elastic) ------------------------

    def keep(self) -> None:
        """Keep the buffers as they are now: what a redone step starts from."""
        self._kept.keep()

    def elastic_progress(self) -> int | None:
        """``update=`` runs completed: the step's owner with ``update=``; else None."""
        return None if self.update is None else self._updates

    def elastic_state(self) -> list[Any]:
        """The parameters, the buffers as the last completed step left them and the counts of
        completed steps and updates."""
        self._counters[:] = self._completed, self._updates
        return self.params + self._kept.arrays() + [self._counters]

    def elastic_restore(self) -> None:
        """Steps are those completed (an interrupted one is dropped, or completed from another
        rank), and so are the buffers."""
        self.steps = self._completed = int(self._counters[0])
        self._updates = int(self._counters[1])
        self._kept.restore()
        if self._manual.size:  # as a completed step leaves them: an interrupted one's marks
            self._has[self._manual] = False  # would count a parameter unused next as used

    def elastic_companions(self) -> list[Any]:
        """The object whose method ``update=`` is (an optimizer), settled with this one."""
        return [] if self.update is None else [update_owner(self.update)]

    def moved(self, comm: MPI.Intracomm) -> None:
        """The owner works on `comm` from now on: so does ``update=``'s library optimizer; no
        step is in progress, and no bucket carries samples."""
        owner = getattr(self.update, "__self__", None)
        if isinstance(owner, ElasticJoinable):  # a library optimizer stepped by update=
            owner.move_to(comm)
        self.step, self.unsynced = None, False
        for bucket in self._buckets:
            bucket.samples.fill(0)

    def join_hook(self, divide_by_initial_world_size: bool) -> JoinHook:
        """The hook that shadows steps on a joined rank."""
        return _ShadowHook(self, divide_by_initial_world_size)


class _ShadowHook(JoinHook):
    def __init__(self, reducer: Reducer, divide_by_initial_world_size: bool) -> None:
        self.reducer = reducer
        self.divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        """Shadow one active step; the averaged gradients land in this rank's ``dp.grads``."""
        self.reducer.shadow_step(self.divide_by_initial_world_size)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Make every rank's params and buffers those of the highest last joiner."""
        self.reducer.final_broadcast(is_last_joiner)
