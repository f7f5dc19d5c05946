"""DataParallel: bucketed, overlapped gradient averaging as a Joinable.

Wire schedule of one active step (a joined rank's main hook shadows exactly this):

1. the heartbeat (Join's, when ``dp`` is the first joinable); the step waits for it, which
   gives ``n``, the number of active ranks;
2. only when ``n < size``: the step control, ``Iallreduce(int64[size + 1], SUM)`` of
   ``[syncs?, one-hot(rank)]``; joined ranks send zeros.  It tells joined ranks whether this
   step synchronises gradients and which ranks are active (``n``, and the highest active
   rank, the root of the buffer broadcast);
3. when there are buffers: one ``Ibcast`` per buffer from the highest active rank;
4. when the step synchronises: one ``Iallreduce(IN_PLACE, SUM)`` per bucket, in bucket order.

With even inputs a step therefore costs the heartbeat, the bucket allreduces and nothing else.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import numpy as np
from mpi4py import MPI

from ..algorithms.comm_joinable import CommJoinable
from ..algorithms.join import Join, JoinHook
from ..buffers import device_of, is_device_array
from ..comm import iallreduce, ibcast
from .buckets import GradientViews, make_buckets

__all__ = ["DataParallel"]


def _check_arrays(arrays: Sequence[Any], name: str, floating: bool) -> list[Any]:
    arrays = list(arrays)
    for i, array in enumerate(arrays):
        if not (isinstance(array, np.ndarray) or is_device_array(array)):
            raise TypeError(f"{name}[{i}] must be a NumPy or CuPy array, got "
                            f"{type(array).__name__}")
        if floating and array.dtype not in (np.float32, np.float64):
            raise TypeError(f"{name}[{i}] must be float32 or float64, got {array.dtype}")
        if array.dtype == object:
            raise TypeError(f"{name}[{i}] has dtype object, which MPI cannot send")
        if not array.flags.c_contiguous:
            raise ValueError(f"{name}[{i}] must be C-contiguous (use numpy.ascontiguousarray)")
    return arrays


def _one_device(arrays: list[Any]) -> str:
    devices = {device_of(a) for a in arrays}
    if len(devices) > 1:
        where = ", ".join(f"[{i}] on {device_of(a)}" for i, a in enumerate(arrays))
        raise ValueError(f"params and buffers must be on one device, got {where}")
    return devices.pop() if devices else "cpu"


class DataParallel(CommJoinable):
    """Average gradients over ranks, in buckets, with uneven numbers of batches per rank.

    Collective over `comm`: every rank constructs it, with the same parameter shapes and
    dtypes; the constructor broadcasts `params` and `buffers` from `broadcast_from`.

    Parameters
    ----------
    params : sequence of arrays
        The trained arrays (NumPy or CuPy, all on one device), owned and updated in place by
        the caller; C-contiguous float32 or float64 (one bucket set per dtype).  Buckets,
        zeroing and averaging stay on that device.
    comm : mpi4py.MPI.Intracomm, optional
        Defaults to ``MPI.COMM_WORLD``; see
        :class:`~tensorplay_mpi.algorithms.comm_joinable.CommJoinable`.
    bucket_cap_mb : float, default 25.0
        Largest bucket in MiB (a larger parameter gets a bucket of its own).
    broadcast_from : int, default 0
        The rank whose params and buffers every rank starts from.
    buffers : sequence of numpy.ndarray, default ()
        Non-trained state (running statistics, ...): broadcast at each step start from the
        highest active rank.
    timeout : float, optional
        Seconds any wait may take (default ``$TENSORPLAY_MPI_TIMEOUT`` or 1800).

    Attributes
    ----------
    grads : GradientViews
        One gradient per parameter, shaped like it: zero-copy views into the buckets.  Write
        the local gradient there during a step; after the step it holds the average.

    Examples
    --------
    ::

        dp = DataParallel(params)
        with Join([dp], divide_by_initial_world_size=True):
            for batch in my_batches:
                with dp.step():
                    backward(params, batch, out=dp.grads)
                update(params, dp.grads)
    """

    def __init__(
        self,
        params: Sequence[np.ndarray],
        comm: MPI.Intracomm | None = None,
        bucket_cap_mb: float = 25.0,
        broadcast_from: int = 0,
        buffers: Sequence[np.ndarray] = (),
        timeout: float | None = None,
    ) -> None:
        super().__init__(comm, timeout)
        self.params = _check_arrays(params, "params", floating=True)
        self.buffers = _check_arrays(buffers, "buffers", floating=False)
        self.device = _one_device(self.params + self.buffers)
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        if not 0 <= broadcast_from < self.size:
            raise ValueError(f"broadcast_from must be a rank in [0, {self.size}), got "
                             f"{broadcast_from!r}")
        self._steps = 0
        self._check_same_on_every_rank()
        self._buckets, self._bucket_of, views = make_buckets(self.params, bucket_cap_mb * 2**20)
        self.grads = GradientViews(views, owner=self)
        self._broadcast(self.params + self.buffers, broadcast_from, "initial broadcast")

        self.divide_by_initial_world_size = True  # set by join_hook() from the Join's kwargs
        self._control = np.zeros(self.size + 1, dtype=np.int64)
        self._ready = np.zeros(len(self.params), dtype=bool)
        self._sync = True  # False inside no_sync()
        self._in_step = False
        self._step_syncs = True
        self._active = self.size
        self._next_bucket = 0  # buckets below it have started their allreduce in this step

    # -- construction --------------------------------------------------------------------

    def _check_same_on_every_rank(self) -> None:
        params, buffers = ([(a.shape, a.dtype.str) for a in arrays]
                           for arrays in (self.params, self.buffers))
        self._check_same_layout((params, buffers), "parameter or buffer shapes/dtypes",
                                f"params {params} and buffers {buffers}")

    def _broadcast(self, arrays: list[np.ndarray], root: int, what: str) -> None:
        self._wait_all([ibcast(self.comm, a, root, f"{what} {i + 1} of {len(arrays)}")
                        for i, a in enumerate(arrays)])

    # -- the public step API --------------------------------------------------------------

    def join(self, **kwargs: Any) -> Join:
        """Shorthand for ``Join([self], **kwargs)``."""
        return Join([self], **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Steps entered inside skip the gradient averaging; gradients accumulate locally.

        Every active rank must use it for the same steps (checked when a rank has joined).
        """
        if self._in_step:
            raise RuntimeError("no_sync() must be entered outside a step, around dp.step()")
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def zero_grad(self) -> None:
        """Set every gradient to zero (for example before accumulating with no_sync)."""
        for bucket in self._buckets:
            bucket.flat.fill(0)

    @contextlib.contextmanager
    def step(self) -> Iterator["DataParallel"]:
        """One training step: heartbeat on enter; on exit every bucket is averaged.

        Collective over ``comm``.  Inside a Join, ``dp`` must be its first joinable (it reads
        the heartbeat).  Outside a Join every rank is taken to be active: with uneven inputs
        the ranks with more batches then wait forever in their bucket allreduce, as they
        would with plain MPI; use a Join.
        """
        if self._in_step:
            raise RuntimeError("dp.step() is already active: steps cannot nest")
        self._begin_step()
        self._in_step = True
        try:
            yield self
        except BaseException as error:
            if self._guard.settle(error, self.timeout):
                self._wait_started_buckets()  # never leave a request behind
            raise
        else:
            self._finish_buckets()
        finally:
            self._in_step = False

    def mark_ready(self, index: int) -> None:
        """Gradient `index` is final for this step: its bucket may start reducing now.

        Call it during the backward pass to overlap communication with computation.
        Buckets start in bucket order on every rank, whatever the order of the calls.
        """
        if not self._in_step:
            raise RuntimeError("mark_ready() is only valid inside dp.step()")
        if not 0 <= index < len(self.params):
            raise IndexError(f"parameter index {index} out of range [0, {len(self.params)})")
        if self._ready[index]:
            raise RuntimeError(f"mark_ready({index}) was already called in this step")
        self._ready[index] = True
        if self._step_syncs:
            self._buckets[self._bucket_of[index]].unready -= 1
            self._start_ready_buckets()

    def _start_ready_buckets(self) -> None:
        """Start the next buckets whose gradients are all ready, one in flight at a time.

        MPI progresses a nonblocking collective only inside MPI calls: this test of the
        bucket in flight, made at every mark_ready(), is where the overlap happens.  One
        bucket at a time: concurrent large allreduces run slower than back-to-back ones
        (``make bench``).
        """
        buckets = self._buckets
        while self._next_bucket < len(buckets) and buckets[self._next_bucket].unready == 0:
            if self._next_bucket and not buckets[self._next_bucket - 1].work.is_completed():
                return
            self._start_bucket(self._next_bucket)

    # -- the active side --------------------------------------------------------------------

    def _begin_step(self) -> None:
        heartbeat = Join.notify_join_context(self)
        join = self.join_context
        if heartbeat is None and join is not None and join.enabled \
                and join.joinables[0] is not self:
            raise RuntimeError("DataParallel must be the first joinable of its Join: "
                               "Join([dp, ...])")
        self._steps += 1
        active = self.size
        if heartbeat is not None:
            active = self._wait(heartbeat)
        self._step_syncs, root = self._sync, self.size - 1
        if active < self.size:
            self._step_syncs, root, active = self._exchange_control(self._sync)
        self._active = active
        self._broadcast(self.buffers, root, "buffer broadcast")
        self._ready[:] = False
        for bucket in self._buckets:
            bucket.unready = len(bucket.members)
        self._next_bucket = 0

    def _exchange_control(self, syncs: bool | None) -> tuple[bool, int, int]:
        """The step control (see the module docstring); `syncs` is None on a joined rank."""
        control = self._control
        control[:] = 0
        if syncs is not None:
            control[0] = int(syncs)
            control[1 + self.rank] = 1
        self._wait(iallreduce(self.comm, MPI.IN_PLACE, control, MPI.SUM,
                              f"step control (step {self._steps})"))
        active_ranks = np.flatnonzero(control[1:])
        active, syncing = len(active_ranks), int(control[0])
        if syncing not in (0, active):
            raise RuntimeError(
                f"{syncing} of {active} active ranks synchronise gradients in this step: every "
                "active rank must use dp.no_sync() for the same steps"
            )
        return syncing > 0, int(active_ranks[-1]), active

    def _start_bucket(self, k: int, shadow: bool = False) -> None:
        bucket = self._buckets[k]
        sendbuf = bucket.zeros if shadow else MPI.IN_PLACE
        bucket.work = iallreduce(self.comm, sendbuf, bucket.flat, MPI.SUM,
                                 f"bucket {k + 1} of {len(self._buckets)} (step {self._steps})")
        self._next_bucket = k + 1

    def _finish_buckets(self, shadow: bool = False) -> None:
        """Start the buckets not started yet (a joined rank: all, sending zeros), then average."""
        if not self._step_syncs:
            return
        divisor = self.size if self.divide_by_initial_world_size else self._active
        last = len(self._buckets) - 1
        for k, bucket in enumerate(self._buckets):
            if self._next_bucket == k:
                self._start_bucket(k, shadow)
            self._wait(bucket.work)
            if self._next_bucket == k + 1 and k < last:
                self._start_bucket(k + 1, shadow)  # posted before this bucket's division
            bucket.flat /= divisor

    def _wait_started_buckets(self) -> None:
        self._wait_all(bucket.work for bucket in self._buckets[:self._next_bucket])

    # -- Joinable -----------------------------------------------------------------------------

    def end_iteration(self) -> None:
        """Before each heartbeat, on every rank: every stateful optimizer bound to
        ``dp.grads`` must be in the Join (``RuntimeError`` naming ``Join([dp, opt])``)."""
        self.grads.check_consumers(self.join_context)

    def join_hook(self, *, divide_by_initial_world_size: bool = True,
                  **kwargs: Any) -> JoinHook:
        """The hook that shadows steps on a joined rank.

        Parameters
        ----------
        divide_by_initial_world_size : bool, default True
            Average over the world size (True) or over the ranks active in the step (False).
        """
        self.divide_by_initial_world_size = bool(divide_by_initial_world_size)
        return _DataParallelHook(self)



class _DataParallelHook(JoinHook):
    def __init__(self, dp: DataParallel) -> None:
        self.dp = dp

    def main_hook(self) -> None:
        """Shadow one active step; the averaged gradients land in this rank's ``dp.grads``."""
        dp = self.dp
        dp._steps += 1
        dp._step_syncs, root, dp._active = dp._exchange_control(None)
        dp._broadcast(dp.buffers, root, "buffer broadcast")
        dp._next_bucket = 0
        dp._finish_buckets(shadow=True)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Broadcast from the highest last joiner: buffers always, params unless all are last.

        Buffers are updated locally in every step, so they differ after the last one; params
        differ only on ranks that joined early (they skipped updates).
        """
        dp = self.dp
        flags = np.array([dp.rank if is_last_joiner else -1, int(not is_last_joiner)],
                         dtype=np.int64)
        dp._wait(iallreduce(dp.comm, MPI.IN_PLACE, flags, MPI.MAX, "last joiner"))
        stale = dp.params + dp.buffers if flags[1] else dp.buffers
        dp._broadcast(stale, int(flags[0]), "final broadcast")
