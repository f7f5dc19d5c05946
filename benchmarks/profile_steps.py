"""Where a step's time goes: microseconds per part, for DataParallel and for JoinableComm.

    OPENBLAS_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py benchmarks/profile_steps.py \\
        --out profile-2-ranks.json

**DataParallel**, with and without a Join:
Even inputs, the model of ``bench_dp.py`` (8 equal float32 parameters, default buckets), an
empty step body (the gradients are refilled outside the timed step), so the step is the
library's path alone: ``dp.step()``'s entry (the Join's heartbeat, the step's set-up), the
buckets (start, wait, division), the step's end.  The library's functions on that path are
wrapped with timers that charge each part its own time (exclusive: a part's callees are
charged to them), so the parts add up to the step; ``rest`` is the step's time outside every
wrapped part (the context manager, the loop).  The wrappers cost about 0.3 us a call, spread
over the parts; ``wrappers`` is the number of wrapped calls per step.  Beside
them, the same bytes through one raw ``comm.Iallreduce(IN_PLACE)`` + ``Wait`` and one 8-byte
``Iallreduce`` + ``Wait`` (the heartbeat's floor), and where MPI-4 has them, one 8-byte
persistent allreduce (``Start`` + ``Wait``: what a persistent heartbeat would take).  Every
figure is the median over the steps of the slowest rank's time, after warm-up steps.

**JoinableComm**: the iteration of ``bench_jc.py`` (``begin_iteration()``, an allreduce of 8
float64, a MAX of one int64, a broadcast of 4 float64) inside ``Join([jc])`` with every rank
active, and with rank 0 joined from the start (the parts of the last rank, which stays active;
its times, not the slowest rank's), against the same three operations in blocking mpi4py.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import time
from collections import defaultdict

import numpy as np
from mpi4py import MPI

from tensorplay_mpi import DataParallel, Join, JoinableComm
from tensorplay_mpi.algorithms import _announcements as announcements
from tensorplay_mpi.algorithms import _joinable_comm as joinable_comm
from tensorplay_mpi.algorithms import join
from tensorplay_mpi.comm import _collectives as collectives
from tensorplay_mpi.comm import _persistent as persistent
from tensorplay_mpi.comm import _work as work
from tensorplay_mpi.parallel import _data_parallel as data_parallel
from tensorplay_mpi.parallel import _reducer as reducer

PIECES = 8

# (owner, attribute, part): the functions on the step's path, each a part of its own
PARTS = [
    (data_parallel.DataParallel, "step", "dp.step(): argument checks"),
    (data_parallel._MustEnter, "__enter__", "step entry (set-up, checks)"),
    (join.Join, "_finish_iterations", "heartbeat: end_iteration of each joinable"),
    (join.Join, "_heartbeat", "heartbeat: bookkeeping, request bits"),
    (join, "iallreduce", "heartbeat: iallreduce (library start path)"),
    (reducer, "iallreduce", "buckets: iallreduce (library start path)"),
    (reducer.Reducer, "_start_bucket", "buckets: flags, start"),
    (reducer.Reducer, "_resolve", "resolve: who is active"),
    (work.Work, "wait_or_abort", "waits (MPI progress and completion)"),
    (work.Work, "result", "results (heartbeat count)"),
    (reducer.Reducer, "_finish_buckets", "buckets: loop, division, used flags"),
    (reducer.Reducer, "_broadcast_buffers", "step end: buffers"),
    (reducer.Reducer, "_after_step", "step end: publish, update"),
    (data_parallel._MustEnter, "__exit__", "step exit (context manager)"),
]
JC_PARTS = [
    (join.Join, "_finish_iterations", "heartbeat: end_iteration (an END announcement)"),
    (join.Join, "_heartbeat", "heartbeat: bookkeeping, request bits"),
    (join, "iallreduce", "heartbeat: iallreduce (library start path)"),
    (joinable_comm.JoinableComm, "begin_iteration", "begin_iteration()"),
    (joinable_comm.JoinableComm, "_allreduce", "allreduce: arguments, dispatch"),
    (joinable_comm.JoinableComm, "_bcast", "bcast: arguments, dispatch"),
    (joinable_comm.JoinableComm, "_ranks_joined", "who is active (the heartbeat's wait)"),
    (joinable_comm.JoinableComm, "_announce", "announcement: set-up"),
    (joinable_comm.JoinableComm, "_exchange_announcement", "announcement: exchange"),
    (joinable_comm.JoinableComm, "_start_operation", "operation: begin, start ready"),
    (joinable_comm.JoinableComm, "_allreduce_data", "allreduce: announce, data"),
    (joinable_comm.JoinableComm, "_bcast_data", "bcast: announce, data"),
    (announcements, "encode", "announcement: encode"),
    (announcements, "decode", "announcement: decode, check"),
    (persistent.PersistentCollectives, "_check", "persistent: the guard's count"),
    (persistent.PersistentCollectives, "_run", "persistent: start, test (MPI)"),
    (persistent.PersistentCollectives, "allreduce", "persistent: copies in and out"),
    (persistent.PersistentCollectives, "bcast", "persistent: copies in and out"),
    (joinable_comm, "iallreduce", "nonblocking allreduce (library start path)"),
    (collectives, "_start", "library start: the guard, a Work"),
    (work.Work, "wait_or_abort", "waits (MPI progress and completion)"),
]


class Timers:
    """Exclusive time per part (ns), and the number of wrapped calls."""

    def __init__(self) -> None:
        self.spent: dict[str, int] = defaultdict(int)
        self.calls = 0
        self._children = [0]  # per open frame: its callees' time

    def wrap(self, fn, part: str):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self.calls += 1
            self._children.append(0)
            start = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter_ns() - start
                children = self._children.pop()
                self.spent[part] += elapsed - children
                self._children[-1] += elapsed
        return timed

    def row(self, whole: str, total_ns: int) -> dict[str, float]:
        """The parts in us, `whole` (`total_ns` in us), the ``rest`` and the ``wrappers``."""
        row = {part: ns / 1e3 for part, ns in self.spent.items()}
        row.update({whole: total_ns / 1e3, "wrappers": self.calls,
                    "rest": (total_ns - sum(self.spent.values())) / 1e3})
        return row

    def reset(self) -> None:
        self.spent.clear()
        self.calls = 0


@contextlib.contextmanager
def instrumented(timers: Timers, parts: list):
    originals = []
    for owner, name, part in parts:
        raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        originals.append((owner, name, raw))
        fn = raw.__func__ if isinstance(raw, staticmethod) else raw
        setattr(owner, name, timers.wrap(fn, part))
    notify = join.Join.__dict__["notify_join_context"]
    originals.append((join.Join, "notify_join_context", notify))
    join.Join.notify_join_context = staticmethod(timers.wrap(notify.__func__,
                                                             "heartbeat: notify_join_context"))
    try:
        yield
    finally:
        for owner, name, raw in reversed(originals):
            setattr(owner, name, raw)


def profile(comm: MPI.Intracomm, dp: DataParallel, use_join: bool, steps: int,
            timers: Timers) -> dict:
    """Per step: each part's time (us) and the step's, slowest rank, median over steps."""
    per_step: list[dict[str, float]] = []
    with Join([dp]) if use_join else contextlib.nullcontext():
        for k in range(steps + 3):
            for bucket in dp._reducer._buckets:
                bucket.flat.fill(1.0)
            timers.reset()
            start = time.perf_counter_ns()
            with dp.step():
                pass
            total = time.perf_counter_ns() - start
            if k >= 3:  # warm-up
                per_step.append(timers.row("step", total))
    parts = sorted({part for row in per_step for part in row})
    slowest = comm.allreduce([[row.get(p, 0.0) for p in parts] for row in per_step],
                             op=_elementwise_max)
    return {p: statistics.median(row[i] for row in slowest) for i, p in enumerate(parts)}


def profile_jc(comm: MPI.Intracomm, iterations: int, timers: Timers) -> dict:
    """JoinableComm's iteration: each part's time (us), every rank active (slowest rank) and
    rank 0 joined (the last rank's), and the blocking mpi4py iteration."""
    s, m, b = np.ones(8), np.ones(1, np.int64), np.ones(4)
    so, mo, bo = np.empty(8), np.empty(1, np.int64), np.empty(4)
    root = comm.size - 1
    jc = JoinableComm(comm)

    def iterate() -> None:
        jc.begin_iteration()
        jc.allreduce(s, out=so)
        jc.allreduce(m, op=MPI.MAX, out=mo)
        jc.bcast(b, root=root, out=bo)

    def run(joined: bool) -> dict:
        rows = []
        with Join([jc]):
            for k in range(iterations + 20 if not (joined and comm.rank == 0) else 0):
                timers.reset()
                start = time.perf_counter_ns()
                iterate()
                total = time.perf_counter_ns() - start
                if k >= 20:
                    rows.append(timers.row("iteration", total))
        parts = sorted({part for row in rows for part in row})
        mine = {p: statistics.median(row.get(p, 0.0) for row in rows) for p in parts}
        if joined:
            return comm.bcast(mine, root=root)
        every = comm.allgather(mine)
        slowest = max(every, key=lambda r: r["iteration"])
        return slowest

    with instrumented(timers, JC_PARTS):
        result = {"all_active": run(False), "one_joined": run(True)}
    times = []
    for k in range(iterations + 20):
        comm.Barrier()
        start = time.perf_counter_ns()
        comm.Allreduce(s, so)
        comm.Allreduce(m, mo, op=MPI.MAX)
        comm.Bcast(b if comm.rank == root else bo, root=root)
        elapsed = comm.allreduce(time.perf_counter_ns() - start, op=MPI.MAX)
        if k >= 20:
            times.append(elapsed / 1e3)
    result["blocking"] = statistics.median(times)
    return result


def _max_rows(a, b, datatype):
    return [[max(x, y) for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]


_elementwise_max = MPI.Op.Create(_max_rows, commute=True)


def raw(comm: MPI.Intracomm, buf: np.ndarray, steps: int, persistent: bool = False) -> float:
    """us of one Iallreduce(IN_PLACE) + Wait of `buf` (`persistent`: a Start + Wait of one
    Allreduce_init request), slowest rank, median."""
    request = comm.Allreduce_init(MPI.IN_PLACE, buf) if persistent else None
    times = []
    for k in range(steps + 3):
        comm.Barrier()
        start = time.perf_counter_ns()
        if request is None:
            comm.Iallreduce(MPI.IN_PLACE, buf).Wait()
        else:
            request.Start()
            request.Wait()
        elapsed = comm.allreduce(time.perf_counter_ns() - start, op=MPI.MAX)
        if k >= 3:
            times.append(elapsed / 1e3)
    if request is not None:
        request.Free()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000000,25000000", help="float32 parameter counts")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    report = {"ranks": comm.size, "cores": os.cpu_count(), "load": os.getloadavg(),
              "mpi": MPI.Get_library_version().splitlines()[0].strip(), "sizes": {}}
    timers = Timers()
    for total in (int(s) for s in args.sizes.split(",")):
        params = [np.zeros(total // PIECES, np.float32) for _ in range(PIECES)]
        dp = DataParallel(params, comm=comm)
        steps = args.steps if total <= 4_000_000 else max(args.steps // 10, 10)
        with instrumented(timers, PARTS):
            rows = {"join": profile(comm, dp, True, steps, timers),
                    "no_join": profile(comm, dp, False, steps, timers)}
        rows["raw_allreduce_us"] = raw(comm, np.ones(total, np.float32), steps)
        rows["raw_8_bytes_us"] = raw(comm, np.ones(1, np.int64), steps)
        if persistent.supported():  # what a persistent heartbeat would take instead
            rows["raw_8_bytes_persistent_us"] = raw(comm, np.ones(1, np.int64), steps, True)
        report["sizes"][str(total)] = rows
        if comm.rank == 0:
            print(f"{comm.size} ranks, {total:,} float32 parameters (us per step, slowest rank, "
                  f"median of {steps}); raw allreduce {rows['raw_allreduce_us']:.1f}, raw "
                  f"8-byte allreduce {rows['raw_8_bytes_us']:.1f} (persistent "
                  f"{rows.get('raw_8_bytes_persistent_us', float('nan')):.1f})")
            print(f"  {'part':48s} {'in a Join':>9s} {'without':>9s}")
            parts = sorted(set(rows["join"]) | set(rows["no_join"]),
                           key=lambda p: (p in ("step", "rest", "wrappers"), p))
            for part in parts:
                print(f"  {part:48s} {rows['join'].get(part, 0):9.1f} "
                      f"{rows['no_join'].get(part, 0):9.1f}")
    report["joinable_comm"] = jc_rows = profile_jc(comm, args.steps * 10, timers)
    if comm.rank == 0:
        print(f"{comm.size} ranks, JoinableComm: us per iteration (median of {args.steps * 10})"
              f"; the same in blocking mpi4py {jc_rows['blocking']:.1f}")
        print(f"  {'part':48s} {'active':>9s} {'1 joined':>9s}")
        parts = sorted(set(jc_rows["all_active"]) | set(jc_rows["one_joined"]),
                       key=lambda p: (p in ("iteration", "rest", "wrappers"), p))
        for part in parts:
            print(f"  {part:48s} {jc_rows['all_active'].get(part, 0):9.1f} "
                  f"{jc_rows['one_joined'].get(part, 0):9.1f}")
    if comm.rank == 0:
        report["load_after"] = os.getloadavg()
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
