"""Reliability under mpiexec: soak, property-based protocol checks, failures all ranks share."""

import re
import time

import numpy as np
import pytest
from helpers import rss_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from toys import AllReducer, run

from tensorplay_mpi import (CollectiveMismatchError, DataParallel, Join, JoinableComm,
                            PeerFailureError)
from tensorplay_mpi.comm import iallreduce, outstanding_requests
from tensorplay_mpi.testing import active_counts, assert_all, raises_everywhere, reset_settings
from tensorplay_mpi.comm._work import progress_pending


@pytest.mark.mpi(min_size=4)
def test_soak_10000_uneven_iterations(comm):
    inputs = [10_000 - 2_500 * r for r in range(comm.size)]  # rank 0 runs all 10,000
    joinable = AllReducer(comm)
    run([joinable], 2_000)  # warm-up: allocator pools, MPI buffers
    before = rss_bytes()
    total = run([joinable], inputs[comm.rank])
    growth = rss_bytes() - before
    expected = sum(active_counts(inputs)[: inputs[comm.rank]])
    assert_all(total == expected, f"total {total} != {expected}")
    assert_all(outstanding_requests() == 0, "requests leaked")
    assert_all(growth < 4 * 2**20, f"resident memory grew by {growth / 2**20:.1f} MiB")


@pytest.mark.mpi
@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_protocol_invariants_hold_for_random_inputs(data):
    comm = MPI.COMM_WORLD.Dup()
    try:
        inputs = data.draw(st.lists(st.integers(0, 5), min_size=comm.size, max_size=comm.size))
        num_joinables = data.draw(st.integers(1, 3))
        num_allreduces = data.draw(st.integers(0, 3))
        throw = data.draw(st.booleans())
        joinables = [AllReducer(comm, num_allreduces) for _ in range(num_joinables)]
        mine, longest = inputs[comm.rank], max(inputs)
        message = total = None
        try:
            total = run(joinables, mine, throw_on_early_termination=throw)
        except RuntimeError as exc:
            message = str(exc)
        uneven = len(set(inputs)) > 1
        if throw and uneven:
            shortest = min(inputs)
            expected = (f"Rank {comm.rank} exhausted all inputs." if mine == shortest else
                        "Detected at least one rank that exhausted inputs. Throwing across all "
                        "ranks.")
            assert_all(message == expected, f"{inputs}: raised {message!r}")
        else:
            want = num_joinables * num_allreduces * sum(active_counts(inputs)[:mine])
            assert_all(total == want, f"{inputs}: total {total} != {want}")
            rounds = [j.main_rounds for j in joinables]
            assert_all(rounds == [longest - mine] * num_joinables, f"{inputs}: rounds {rounds}")
            posts = [j.post_hooks for j in joinables]
            assert_all(posts == [[mine == longest]] * num_joinables, f"{inputs}: posts {posts}")
        assert_all(outstanding_requests() == 0, f"{inputs}: requests leaked")
    finally:
        comm.Free()


@pytest.mark.mpi(min_size=2)
def test_an_inter_communicator_is_a_type_error(comm):
    half = comm.Split(comm.rank % 2, comm.rank)
    inter = half.Create_intercomm(0, comm, 1 - comm.rank % 2)  # leaders: world ranks 0, 1
    try:
        with raises_everywhere(TypeError, match="Intracomm"):
            Join([AllReducer(inter)])
    finally:
        inter.Free()
        half.Free()


@pytest.mark.mpi(min_size=2)
def test_debug_mismatch_raises_everywhere_and_the_communicator_stays_usable(comm, monkeypatch):
    monkeypatch.setenv("TENSORPLAY_MPI_DEBUG", "1")
    reset_settings()
    joinable = AllReducer(comm)
    with raises_everywhere(CollectiveMismatchError,
                           match=re.escape("rank 1: allreduce 3xfloat64 op=SUM  [extra]")):
        with Join([joinable]):
            for i in range(4):
                if comm.rank == 1 and i == 2:  # a collective the other ranks do not issue
                    iallreduce(comm, np.ones(3), np.empty(3), what="extra").wait()
                joinable()
    total = run([AllReducer(comm)], 1 + comm.rank)  # the same communicator, next Join
    expected = sum(active_counts([1 + r for r in range(comm.size)])[: 1 + comm.rank])
    assert_all(total == expected, f"next Join total {total} != {expected}")


@pytest.mark.mpi
def test_every_rank_failing_after_a_step_keeps_its_own_exception(comm):
    dp = DataParallel([np.zeros(3)], comm=comm)
    error = None
    try:
        with Join([dp]):
            for i in range(3):
                with dp.step():
                    dp.grads[0] = np.ones(3)
                if i == 1:
                    raise KeyError(f"same bug on rank {comm.rank}")
    except (KeyError, PeerFailureError) as exc:
        error = exc
    assert_all(isinstance(error, KeyError), f"got {error!r}")
    with Join([dp]):  # the communicator is still usable
        for _ in range(2 + comm.rank):
            with dp.step():
                dp.grads[0] = np.full(3, float(comm.rank))
    assert_all(outstanding_requests() == 0, "requests leaked")


@pytest.mark.mpi(min_size=2)
def test_a_waiting_rank_backs_off_instead_of_spinning(comm):
    joinable = AllReducer(comm, num_allreduces=0)
    with Join([joinable]):
        if comm.rank == 1:
            time.sleep(1.0)  # rank 0 has joined and polls meanwhile
            joinable()
        cpu_start = time.process_time()
    cpu = time.process_time() - cpu_start
    assert_all(comm.rank != 0 or cpu < 0.5, f"rank 0 burnt {cpu:.2f} s of CPU in 1 s of waiting")


@pytest.mark.mpi(min_size=2)
def test_a_dropped_work_keeps_its_buffers_until_the_operation_completes(comm):
    n = 1 << 16
    if comm.rank == 0:
        time.sleep(0.2)  # the peers' operation stays pending meanwhile
    iallreduce(comm, np.ones(n), np.empty(n))  # dropped at once
    fresh = [np.full(n, -1.0) for _ in range(8)]  # would reuse freed buffers
    while outstanding_requests():
        progress_pending()
    intact = all((a == -1.0).all() for a in fresh)
    assert_all(intact, "a dropped operation wrote into memory allocated after it")


@pytest.mark.mpi(min_size=2)
def test_completed_operations_are_released_without_anyone_waiting_for_them(comm):
    if comm.rank == 0:
        time.sleep(0.2)  # the dropped operations stay pending for a while on the others
    for _ in range(100):
        iallreduce(comm, np.ones(1 << 15), np.empty(1 << 15))  # dropped at once
    for _ in range(1000):
        iallreduce(comm, np.ones(1), np.empty(1)).wait()
    pending = outstanding_requests()
    assert_all(pending == 0, f"{pending} completed operations (and their buffers) still held")


@pytest.mark.mpi(min_size=2)
def test_after_every_rank_fails_alike_every_pending_operation_completes(comm):
    jc = JoinableComm(comm)
    caught = None
    try:
        with Join([jc]):
            jc.begin_iteration()
            jc.iallreduce(np.ones(1_000_000))  # dropped, pending when every rank raises
            raise KeyError("the same bug on every rank")
    except KeyError as exc:
        caught = exc
    assert_all(caught is not None and outstanding_requests() == 0,
               f"caught {caught!r}, {outstanding_requests()} operations pending")
    with Join([jc]):  # the communicator is intact: the next Join works
        for _ in range(1 + comm.rank):
            jc.begin_iteration()
            total = jc.allreduce(np.ones(1))
    assert_all(total[0] == comm.size - comm.rank,
               f"total {total}")
