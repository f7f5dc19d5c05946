"""The registry of pending operations stays linear: many started, waited by another thread,
some dropped (each start costs O(1) amortised, whatever is pending)."""

import queue
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

from tensorplay_mpi.comm import iallreduce
from tensorplay_mpi.comm import _work as registry
from tensorplay_mpi.testing import assert_all

OPS = 12_000  # about a second at 2 ranks here; the 30,000 case is benchmarks/bench_registry.py


def _start_many(comm, ops, dropped_every=4, lag=64):
    """Start `ops` allreduces of ``full(4, i)``; a helper thread waits for all but every
    `dropped_every`-th, which is dropped (at most `lag` behind the starts, a pipeline: only the
    dropped ones pile up; 0: no cap, everything may pile up).  Returns the results, in start
    order."""
    waits: queue.Queue = queue.Queue(maxsize=lag)
    waited = []

    def helper():
        while (work := waits.get()) is not None:
            work.wait(timeout=60)
            waited.append(work)

    thread = threading.Thread(target=helper)
    thread.start()
    results = []
    try:
        for i in range(ops):
            recv = np.empty(4)
            work = iallreduce(comm, np.full(4, float(i)), recv, MPI.SUM, "registry test")
            results.append(recv)
            if i % dropped_every != dropped_every - 1:
                waits.put(work)
    finally:
        waits.put(None)
        thread.join()
    return results, len(waited)


@pytest.mark.mpi(min_size=2)
def test_many_operations_waited_by_a_thread_and_dropped_complete_exactly_in_linear_sweeps(comm):
    before = registry.sweep_tests()
    results, waited = _start_many(comm, OPS)
    swept = registry.sweep_tests() - before
    registry.complete_pending(None, 60.0)  # the dropped ones still pending
    wrong = [i for i, r in enumerate(results) if not (r == i * comm.size).all()]
    assert_all(not wrong and waited == OPS - OPS // 4,
               f"wrong sums at {wrong[:5]}, {waited} waited")
    # Every sweep tests what is pending, at most every max(32, pending) starts: at most about
    # two tests a start whatever piles up (a quadratic registry would test ~OPS/8 a start).
    assert_all(swept <= 3 * OPS, f"{swept} sweep tests for {OPS} starts")
    assert_all(registry.outstanding_requests() == 0,
               f"{registry.outstanding_requests()} operations still pending")


@pytest.mark.mpi(min_size=2)
def test_a_helper_that_falls_behind_without_bound_keeps_the_registry_linear(comm):
    """The round-4 case without the cap: the helper's lag grows with the run.  The registry's
    own work (its sweeps' request tests) stays O(1) a start at N and at 2N, where a quadratic
    registry would test ~N/8 a start; wall time is MPI's too, so it is the benchmark's
    (benchmarks/bench_registry.py, unbounded lag, against raw mpi4py)."""
    per_start = []
    for ops in (OPS // 4, OPS // 2):
        before = registry.sweep_tests()
        results, waited = _start_many(comm, ops, lag=0)
        per_start.append((registry.sweep_tests() - before) / ops)
        registry.complete_pending(None, 60.0)
        wrong = [i for i, r in enumerate(results) if not (r == i * comm.size).all()]
        assert_all(not wrong and waited == ops - ops // 4, f"wrong sums at {wrong[:5]}")
    assert_all(max(per_start) <= 3, f"sweep tests per start at N and 2N: {per_start}")


@pytest.mark.mpi(min_size=2)
def test_a_sweep_completes_dropped_operations_and_skips_none_that_are_done(comm):
    recvs = [np.empty(2) for _ in range(100)]
    for i, recv in enumerate(recvs):  # all dropped
        iallreduce(comm, np.full(2, float(i)), recv, MPI.SUM, "dropped")
    comm.Barrier()  # every rank has started them all: they can complete
    deadline = time.monotonic() + 30  # a loaded machine, or Open MPI's progress, takes longer
    while registry.outstanding_requests() and time.monotonic() < deadline:
        registry.sweep_pending()
    pending = registry.outstanding_requests()
    registry.complete_pending(None, 60.0)
    wrong = [i for i, r in enumerate(recvs) if not (r == i * comm.size).all()]
    assert_all(pending == 0 and not wrong, f"{pending} pending after sweeps; wrong {wrong[:5]}")
