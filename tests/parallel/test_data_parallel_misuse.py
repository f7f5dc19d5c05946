"""DataParallel misuse under mpiexec: one rank's mistake is a clear error on every rank."""

import time

import numpy as np
import pytest
from linear import make_problem, replay, train

from tensorplay_mpi import DataParallel, Join
from tensorplay_mpi.comm import outstanding_requests
from tensorplay_mpi.testing import assert_all, reset_settings


def error_of(fn):
    """The exception `fn` raises, or None."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc
    return None


def expect_everywhere(error, kind, text):
    assert_all(isinstance(error, kind) and text in str(error),
               f"expected {kind.__name__} with {text!r}, got {error!r}")


@pytest.mark.mpi(min_size=2)
def test_ranks_passing_different_broadcast_from_fail_on_every_rank(comm):
    error = error_of(lambda: DataParallel([np.zeros(2)], comm=comm, broadcast_from=comm.rank))
    expect_everywhere(error, ValueError, "ranks passed different broadcast_from values")


@pytest.mark.mpi(min_size=2)
def test_ranks_passing_different_bucket_caps_fail_on_every_rank(comm):
    error = error_of(lambda: DataParallel([np.zeros(2)], comm=comm,
                                          bucket_cap_mb=1.0 + comm.rank))
    expect_everywhere(error, ValueError, "ranks passed different bucket_cap_mb values")


@pytest.mark.mpi(min_size=2)
def test_a_read_only_param_on_a_non_root_rank_fails_on_every_rank(comm):
    param = np.zeros(3)
    param.flags.writeable = comm.rank != 1
    error = error_of(lambda: DataParallel([param], comm=comm))
    if comm.rank == 1:
        expect_everywhere(error, ValueError, "params[0] is read-only")
    else:
        expect_everywhere(error, ValueError, "DataParallel argument check failed on rank(s) [1] "
                                             "(rank 1: ValueError: params[0] is read-only")


@pytest.mark.mpi(min_size=2)
def test_int_params_on_one_rank_fail_on_every_rank(comm):
    param = np.zeros(3, dtype=np.int64 if comm.rank == 0 else np.float64)
    error = error_of(lambda: DataParallel([param], comm=comm))
    text = ("must be float32, float64, float16 or bfloat16" if comm.rank == 0 else
            "DataParallel argument check failed on rank(s) [0] (rank 0: TypeError: ")
    expect_everywhere(error, TypeError, text)


@pytest.mark.mpi(min_size=2)
def test_a_bad_broadcast_from_on_one_rank_fails_on_every_rank(comm):
    root = 0.5 if comm.rank == comm.size - 1 else 0
    error = error_of(lambda: DataParallel([np.zeros(2)], comm=comm, broadcast_from=root))
    expect_everywhere(error, TypeError, "broadcast_from must be an int rank, got 0.5"
                      if comm.rank == comm.size - 1 else
                      f"DataParallel argument check failed on rank(s) [{comm.size - 1}]")


@pytest.mark.mpi(min_size=2)
def test_the_divisor_comes_from_the_join_the_step_runs_in(comm):
    """A Join made later with another option, never entered, changes nothing."""
    def make_join(dp):
        join = Join([dp], divide_by_initial_world_size=False)
        Join([dp], divide_by_initial_world_size=True)  # its hook is made, then dropped
        return join

    data, inputs = make_problem(), [2 + r for r in range(comm.size)]
    params, dp = train(comm, data, inputs, make_join=make_join)
    expected = replay(data, inputs, divide_by_initial_world_size=False)
    assert_all(all(np.allclose(p, e, rtol=1e-12, atol=0) for p, e in zip(params, expected)),
               f"params {params} != replay {expected}")


@pytest.mark.mpi(min_size=3)
def test_joined_ranks_disagreeing_on_the_divisor_fail_on_every_rank(comm):
    dp = DataParallel([np.zeros(2)], comm=comm)
    inputs = 0 if comm.rank < 2 else 1  # ranks 0 and 1 join at once, with different options

    def run():
        with Join([dp], divide_by_initial_world_size=comm.rank != 1):
            for _ in range(inputs):
                with dp.step():
                    dp.grads[0] = np.ones(2)

    error = error_of(run)
    expect_everywhere(error, ValueError, "joined ranks passed different "
                      "divide_by_initial_world_size to their Join (1 True, 1 False)")
    assert_all(outstanding_requests() == 0, "requests pending after the failure")


@pytest.mark.mpi(min_size=2)
def test_a_step_waits_for_the_heartbeat_only_where_its_count_is_needed(comm, monkeypatch):
    """Rank 0 sends from inside its step, before any bucket; rank 1 receives that before it
    enters its own step.  A step that waited for the heartbeat on entry would deadlock.
    (Not in debug mode, whose signature check before the heartbeat is a synchronisation.)"""
    monkeypatch.setenv("TENSORPLAY_MPI_DEBUG", "0")
    reset_settings()
    side = comm.Dup()
    dp = DataParallel([np.zeros(2)], comm=comm)
    received = None
    with Join([dp]):
        if comm.rank == 0:
            with dp.step():
                side.send("in the step", dest=1)
                dp.grads[0] = np.ones(2)
        else:
            if comm.rank == 1:
                request = side.irecv(source=0)
                for _ in range(10_000):  # 10 s at most, then give up instead of hanging
                    done, received = request.test()
                    if done:
                        break
                    time.sleep(1e-3)
                else:
                    request.Cancel()
                    request.Wait()
            with dp.step():
                dp.grads[0] = np.ones(2)
    side.Free()
    assert_all(comm.rank != 1 or received == "in the step", f"rank 1 received {received!r}")
    assert_all(np.array_equal(dp.grads[0], np.ones(2)), f"grads {dp.grads[0]}")


@pytest.mark.mpi(min_size=2)
def test_every_rank_failing_with_different_buckets_started_recovers(comm, monkeypatch):
    """Rank 0 has started bucket 1 of 3 when every rank raises the same error (the others
    none): the failure path starts it on the others too, and the next Join works.  (Not in
    debug mode: there rank 0 waits in the signature check of bucket 1, which the others never
    reach before they fail, so the failure is settled as a partial one.)"""
    monkeypatch.setenv("TENSORPLAY_MPI_DEBUG", "0")
    reset_settings()
    dp = DataParallel([np.zeros(4) for _ in range(3)], comm=comm, bucket_cap_mb=1e-6)
    caught = None
    try:
        with Join([dp]):
            with dp.step():
                if comm.rank == 0:
                    for i in reversed(range(3)):
                        dp.mark_ready(i)  # bucket 2 waits for bucket 1, which waits for peers
                raise KeyError(f"the same bug on rank {comm.rank}")
    except KeyError as exc:
        caught = exc
    assert_all(isinstance(caught, KeyError) and str(comm.rank) in str(caught)
               and outstanding_requests() == 0,
               f"caught {caught!r}, {outstanding_requests()} operations pending")
    with Join([dp]):
        for _ in range(1 + comm.rank):
            with dp.step():
                for g in dp.grads:
                    g[...] = 1.0
    # the last step has only the last rank active; joined ranks' hooks get its average too
    assert_all(all(np.all(g == 1.0 / comm.size) for g in dp.grads),
               f"grads {[g.tolist() for g in dp.grads]} after the recovery")
