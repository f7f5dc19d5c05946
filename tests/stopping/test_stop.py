"""Coordinated stops under mpiexec: every rank leaves at one iteration, exactly, nothing pending."""

import os
import signal
import time

import numpy as np
import pytest
from helpers import gathered_equal

from tensorplay_mpi import (SGD, DataParallel, Join, clear_stop, request_stop, stop_on_signals,
                            stop_requested)
from tensorplay_mpi.comm import outstanding_requests
from tensorplay_mpi.comm._guard import Guard
from tensorplay_mpi.testing import assert_all, reset_settings


def train(comm, inputs, stop_at=None, stopper=0, how="call"):
    """Uneven DataParallel + SGD loop; rank `stopper` asks to stop in its iteration `stop_at`.

    Returns the iterations this rank ran, the Join and the parameters.
    """
    params = [np.zeros(3), np.zeros(2)]
    dp = DataParallel(params, comm=comm, bucket_cap_mb=16 / 2**20)
    opt = SGD(params, dp.grads, lr=0.1, momentum=0.5)
    ran = 0
    with stop_on_signals(), Join([dp, opt]) as join:
        for i in range(inputs[comm.rank]):
            if join.stopped:
                break
            if comm.rank == stopper and i == stop_at:
                if how == "call":
                    request_stop("test")
                else:
                    os.kill(os.getpid(), how)
            with dp.step():
                for k, grad in enumerate(dp.grads):
                    grad[...] = comm.rank + i + k
            opt.step()
            ran += 1
    return ran, join, params


@pytest.mark.mpi
@pytest.mark.parametrize("how", ["call", signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_a_stop_on_one_rank_stops_every_rank_after_the_same_iteration(comm, how):
    inputs = [6 + 2 * r for r in range(comm.size)]
    stopper = comm.size - 1
    ran, join, params = train(comm, inputs, stop_at=2, stopper=stopper, how=how)
    every_ran = comm.allgather(ran)
    # the request rides in heartbeat 3; every rank sees it at the top of iteration 4
    assert_all(every_ran == [3] * comm.size, f"iterations run {every_ran}")
    assert_all(join.stopped, "join.stopped is false")
    reason = join.stop_reason
    own = {"call": "test"}.get(how) or (signal.Signals(how).name if how != "call" else None)
    expected = own if comm.rank == stopper else "a stop requested by 1 other rank(s)"
    assert_all(reason == expected, f"stop_reason {reason!r} != {expected!r}")
    assert_all(gathered_equal(params, comm), "parameters differ between ranks")
    assert_all(outstanding_requests() == 0, "operations pending after a stop")
    clear_stop()
    assert_all(join.stop_reason == reason, "stop_reason changed with clear_stop()")


@pytest.mark.mpi(min_size=2)
def test_a_joined_rank_carries_a_stop_in_its_poll(comm):
    inputs = [1] + [8] * (comm.size - 1)  # rank 0 joins after one iteration
    params = [np.zeros(2)]
    dp = DataParallel(params, comm=comm)
    ran = 0
    with Join([dp]) as join:
        for _ in range(inputs[comm.rank]):
            if join.stopped:
                break
            with dp.step():
                dp.grads[0][...] = 1.0
            params[0] -= dp.grads[0]
            ran += 1
        if comm.rank == 0:
            request_stop("joined rank")
    every_ran = comm.allgather(ran)
    assert_all(every_ran[0] == 1 and len(set(every_ran[1:])) == 1 and every_ran[1] < 8,
               f"iterations run {every_ran}")
    assert_all(join.stopped and gathered_equal(params, comm), "not stopped together")


@pytest.mark.mpi
def test_without_a_request_the_join_is_not_stopped_and_runs_every_input(comm):
    inputs = [2 + r for r in range(comm.size)]
    ran, join, _ = train(comm, inputs)
    assert_all(ran == inputs[comm.rank] and not join.stopped and join.stop_reason is None,
               f"ran {ran}, stopped {join.stopped}")


@pytest.mark.mpi
def test_a_pending_stop_rides_in_the_first_heartbeat_of_the_next_join(comm):
    request_stop("between epochs")
    ran, join, _ = train(comm, [5] * comm.size)
    assert_all(ran == 1 and join.stopped, f"ran {ran}, stopped {join.stopped}")
    assert_all(stop_requested() == "between epochs", "the request was consumed")


@pytest.mark.mpi
def test_a_disabled_join_never_stops(comm):
    dp = DataParallel([np.zeros(2)], comm=comm)
    request_stop()
    with Join([dp], enable=False) as join:
        with dp.step():
            dp.grads[0][...] = 1.0
    assert_all(not join.stopped, "a disabled Join reported a stop")


@pytest.mark.mpi(min_size=2)
def test_a_stall_report_leaves_nothing_pending(comm, monkeypatch, capfd):
    monkeypatch.setenv("TENSORPLAY_MPI_STALL", "0.3")
    reset_settings()
    try:
        params = [np.zeros(2)]
        dp = DataParallel(params, comm=comm)
        with Join([dp]):
            for i in range(3 + comm.rank):
                if comm.rank == 1 and i == 1:
                    time.sleep(1.5)  # the others wait in their step: one report each
                with dp.step():
                    dp.grads[0][...] = i
    finally:
        monkeypatch.delenv("TENSORPLAY_MPI_STALL")
        reset_settings()
    reported = "has waited" in capfd.readouterr().err
    assert_all(comm.rank == 1 or reported, "no stall report")
    assert_all(outstanding_requests() == 0, "the stall report left operations pending")


@pytest.mark.mpi
@pytest.mark.parametrize("stop", [False, True])
def test_an_even_input_step_starts_exactly_the_collectives_it_did_before(comm, monkeypatch,
                                                                         stop):
    """Heartbeat, one allreduce per bucket, and on leaving one poll and the last-joiner flag:
    a stop request adds nothing."""
    started = []
    before = Guard.before_collective

    def record(guard, kind, what, signature, description=None):
        started.append((kind, what))
        before(guard, kind, what, signature, description)

    params = [np.zeros(3), np.zeros(2)]
    dp = DataParallel(params, comm=comm, bucket_cap_mb=16 / 2**20)  # two buckets
    monkeypatch.setattr(Guard, "before_collective", record)
    if stop:
        request_stop()
    with Join([dp]):
        for _ in range(3):
            with dp.step():
                for grad in dp.grads:
                    grad[...] = 1.0
    expected = []
    for step in (1, 2, 3):
        expected += [("allreduce", f"heartbeat (iteration {step})"),
                     ("allreduce", f"bucket 1 of 2 (step {step})"),
                     ("allreduce", f"bucket 2 of 2 (step {step})")]
    expected += [("allreduce", "poll (round 1 after joining)"), ("allreduce", "last joiner")]
    assert_all(started == expected, f"started {started}")
