"""Failures: every rank ends non-zero, fast, and the output says why; and, under mpiexec,
reliability: soak, property-based protocol checks, failures all ranks share.

Each serial case runs tests/programs/failures.py with a hard outer timeout; rank 1 misbehaves in
iteration 3 of 10.
"""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import PROGRAMS, results, rss_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from toys import AllReducer, run

from tensorplay_mpi import (CollectiveMismatchError, DataParallel, Join, JoinableComm,
                            PeerFailureError)
from tensorplay_mpi.comm import iallreduce, outstanding_requests
from tensorplay_mpi.comm._work import sweep_pending
from tensorplay_mpi.testing import (active_counts, assert_all, mpiexec_path, raises_everywhere,
                                    reset_settings, run_mpi)

PROGRAM = str(PROGRAMS / "failures.py")
RANKS = [2, 3, 4]


def run_failing(nprocs, mode, timeout=60, program=PROGRAM, **env):
    """Run `program` (failures.py) in `mode`; the result and the seconds it took."""
    start = time.monotonic()
    result = run_mpi(nprocs, [program, mode], timeout=timeout, **env)
    return result, time.monotonic() - start


@pytest.mark.parametrize("nprocs", RANKS)
def test_an_exception_on_one_rank_ends_every_rank_within_seconds(nprocs):
    result, elapsed = run_failing(nprocs, "raise")
    outcomes = results(result.stdout)
    assert result.returncode != 0 and elapsed < 10, (elapsed, result.stdout, result.stderr)
    assert outcomes[1] == "ValueError: boom in iteration 3"
    for rank in set(range(nprocs)) - {1}:
        assert outcomes[rank].startswith(
            f"PeerFailureError: rank {rank}: rank 1 failed with ValueError: boom in iteration 3")


@pytest.mark.parametrize("nprocs", RANKS)
def test_a_rank_killed_with_sigkill_ends_the_job(nprocs):
    result, elapsed = run_failing(nprocs, "kill", timeout=60, TENSORPLAY_MPI_TIMEOUT="10")
    assert result.returncode != 0 and elapsed < 30, (elapsed, result.stdout, result.stderr)


@pytest.mark.parametrize("nprocs", [2, *(pytest.param(n, marks=pytest.mark.slow) for n in (3, 4))])
def test_a_stalled_rank_times_out_with_a_report_and_an_abort(nprocs):
    result, elapsed = run_failing(nprocs, "stall", timeout=60, TENSORPLAY_MPI_TIMEOUT="2")
    assert result.returncode != 0 and elapsed < 20, (elapsed, result.stdout, result.stderr)
    reports = re.findall(r"CollectiveTimeoutError: rank (\d+): (.*) did not complete after "
                         r"([\d.]+) s \(timeout 2 s\)", result.stderr)
    assert reports, result.stderr
    for rank, what, waited in reports:
        assert int(rank) != 1 and "iteration 3" in what and float(waited) >= 2.0


@pytest.mark.slow  # waits out its deadline
def test_a_stalled_wait_is_reported_once_with_where_every_rank_is():
    result, _ = run_failing(3, "stall", timeout=60, TENSORPLAY_MPI_TIMEOUT="8",
                            TENSORPLAY_MPI_STALL="2")
    reports = re.findall(r"tensorplay_mpi: rank (\d+) has waited \d+ s for (.*?) \(collective "
                         r"\d+ on its communicator\); still waiting.*", result.stderr)
    assert sorted(rank for rank, _ in reports) == ["0", "2"], result.stderr  # once each
    for line in re.findall(r"tensorplay_mpi: rank \d+ has waited.*", result.stderr):
        assert "iteration 3" in line and "Not in a library wait: ranks [1]" in line, line
        assert re.search(r"Waiting for the same collective: ranks \[[02]\]", line), line
        assert "a collective of your own" in line and "use a JoinableComm" in line, line
    assert result.stderr.index("has waited") < result.stderr.index("CollectiveTimeoutError")


@pytest.mark.slow
def test_stall_reports_can_be_turned_off():
    result, _ = run_failing(2, "stall", timeout=60, TENSORPLAY_MPI_TIMEOUT="4",
                            TENSORPLAY_MPI_STALL="0")
    assert "CollectiveTimeoutError" in result.stderr and "has waited" not in result.stderr


@pytest.mark.parametrize("nprocs", RANKS)
def test_an_extra_collective_in_debug_mode_is_a_mismatch_on_every_rank(nprocs):
    result, elapsed = run_failing(nprocs, "mismatch", TENSORPLAY_MPI_DEBUG="1")
    outcomes = results(result.stdout)
    assert result.returncode != 0 and elapsed < 10, (elapsed, result.stdout, result.stderr)
    assert sorted(outcomes) == list(range(nprocs)), result.stdout
    for outcome in outcomes.values():
        assert outcome.startswith("CollectiveMismatchError: ranks are about to issue different")
    listing = result.stdout.split("RESULT rank=0", 1)[1]
    assert re.search(r"rank 1: allreduce 3xfloat64 op=SUM", listing)
    assert re.search(r"rank 0: allreduce 1xint64 op=SUM  \[heartbeat \(iteration 3\)\]", listing)


@pytest.mark.parametrize("variable", ["SLURM_STEP_NUM_TASKS", "PMI_SIZE"])
def test_several_tasks_of_one_rank_each_is_a_launch_error(variable):
    code = ("import numpy as np\nfrom tensorplay_mpi import DataParallel\n"
            "DataParallel([np.zeros(2)])\n")
    env = dict(os.environ, **{variable: "4"})
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode != 0
    assert f"MPI.COMM_WORLD has 1 rank but {variable}=4" in result.stderr, result.stderr
    assert "srun --mpi=pmi2" in result.stderr and "srun --mpi=pmix" in result.stderr


MISUSE = str(PROGRAMS / "misuse.py")


@pytest.mark.parametrize("mode, message", [
    ("post_hook", "ValueError: post hook boom"),
    ("disabled", "ValueError: boom in a disabled Join"),
    ("step", "ValueError: boom in a step without a Join"),
])
@pytest.mark.parametrize("nprocs", [2, 3])
def test_a_failure_that_peers_never_wait_for_still_ends_the_job_with_its_error(
        nprocs, mode, message):
    result, elapsed = run_failing(nprocs, mode, timeout=90, program=MISUSE,
                                  TENSORPLAY_MPI_GRACE="3")
    assert result.returncode != 0 and elapsed < 30, (elapsed, result.stdout, result.stderr)
    assert results(result.stdout)[1] == message, result.stdout
    assert message in result.stderr, result.stderr  # the traceback reaches the job's output


def test_in_a_step_without_a_join_every_peer_raises_a_peer_failure_error():
    result = run_mpi(3, [MISUSE, "step"], timeout=90)
    outcomes = results(result.stdout)
    assert outcomes[1] == "ValueError: boom in a step without a Join", result.stdout
    for rank in (0, 2):
        assert outcomes[rank].startswith(f"PeerFailureError: rank {rank}: rank 1 failed with "
                                         "ValueError: boom in a step without a Join"), outcomes


@pytest.mark.parametrize("opt_out, ends", [("1", True),
                                            pytest.param("0", False, marks=pytest.mark.slow)])
def test_an_uncaught_exception_without_mpi4py_run_aborts_the_job(opt_out, ends):
    """Without ``-m mpi4py`` the library's excepthook aborts on one rank's uncaught error
    (TENSORPLAY_MPI_EXCEPTHOOK=0: it does not)."""
    job, stderr = _launch(["-n", "2", sys.executable, MISUSE, "uncaught"],
                          TENSORPLAY_MPI_EXCEPTHOOK=opt_out)
    if job is None:
        assert not ends, "the job did not end within 15 s"
        return
    assert ends, "the job ended although the excepthook was turned off"
    assert job.returncode != 0
    assert "ValueError: boom between epochs" in stderr, stderr
    assert "rank 1: uncaught ValueError: aborting the MPI job" in stderr, stderr


def test_a_nonzero_sys_exit_on_one_rank_ends_the_job_under_mpi4py_run():
    """The library leaves ``sys.exit`` alone; ``python -m mpi4py``, the documented launch,
    turns one rank's ``sys.exit(3)`` into an abort of the job."""
    job, stderr = _launch(["-n", "2", sys.executable, "-m", "mpi4py", MISUSE, "exit"])
    assert job is not None, "the job did not end within 15 s"
    assert job.returncode != 0, stderr


def _launch(args, **env):
    """mpiexec ARGS; (the job, its stderr), or (None, "") if it did not end within 15 s."""
    job = subprocess.Popen([mpiexec_path(), *args], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=dict(os.environ, **env),
                           start_new_session=True)
    try:
        _, stderr = job.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)  # mpiexec and every rank
        job.communicate()
        return None, ""
    return job, stderr


def test_sys_exit_0_inside_a_join_on_one_rank_ends_the_job_at_once_and_says_why():
    result, elapsed = run_failing(2, "exit0", program=MISUSE)
    assert result.returncode != 0 and elapsed < 8, (elapsed, result.stderr)
    assert results(result.stdout)[0].startswith(
        "PeerFailureError: rank 0: rank 1 failed with SystemExit: 0"), result.stdout
    # rank 1's pending operations were completed (drained): rank 0's error ends the job
    assert "rank 1 failed with SystemExit: 0" in result.stderr, result.stderr
    assert "never matched" not in result.stderr, result.stderr


def test_a_sys_exit_in_a_thread_does_not_abort_a_job_that_ends_normally():
    cmd = [mpiexec_path(), "-n", "2", sys.executable, MISUSE, "exit_thread"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert results(result.stdout) == {0: "ok", 1: "ok"}, result.stdout


@pytest.mark.slow  # waits out the grace period
def test_a_rank_that_comes_to_the_agreement_after_the_grace_gets_the_same_verdict():
    result, elapsed = run_failing(2, "late", program=MISUSE, TENSORPLAY_MPI_GRACE="2")
    outcomes = results(result.stdout)
    assert result.returncode != 0 and elapsed < 20, (elapsed, result.stdout, result.stderr)
    for rank in (0, 1):
        assert outcomes[rank].startswith("RuntimeError: ") and "unusable" in outcomes[rank], \
            outcomes


def test_an_operation_pending_when_the_communicator_breaks_fails_at_once():
    result, elapsed = run_failing(2, "continue", program=MISUSE, TENSORPLAY_MPI_TIMEOUT="30")
    outcomes = results(result.stdout)
    assert result.returncode != 0 and elapsed < 15, (elapsed, result.stdout, result.stderr)
    assert outcomes[1] == "ValueError: bad batch on rank 1", outcomes
    assert outcomes[0].startswith("RuntimeError: rank 0: heartbeat (iteration 3) cannot "
                                  "complete: the communicator is unusable"), outcomes


def test_a_work_waited_for_in_another_thread_is_never_tested_by_two_threads_at_once():
    result = run_mpi(2, [str(PROGRAMS / "threads.py")], timeout=90)
    assert results(result.stdout) == {0: "ok", 1: "ok"}, (result.stdout, result.stderr)


@pytest.mark.parametrize("debug", ["0", pytest.param("1", marks=pytest.mark.slow)])
def test_a_timeout_names_the_likely_causes_and_nothing_follows_it(debug):
    result = run_mpi(2, [MISUSE, "own"], timeout=60, TENSORPLAY_MPI_TIMEOUT="3",
                     TENSORPLAY_MPI_DEBUG=debug)
    assert result.returncode != 0, result.stdout
    assert "CollectiveTimeoutError" in result.stderr, result.stderr
    assert "a joinable missing from the Join's list" in result.stderr
    assert "a collective of your own" in result.stderr
    assert "has not completed yet" not in result.stderr, result.stderr
    suggested = "TENSORPLAY_MPI_DEBUG=1 names" in result.stderr
    assert suggested == (debug == "0"), "debug mode suggested while on, or not while off"


# -- under mpiexec at any rank count (@pytest.mark.mpi) --------------------------------------------

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
        sweep_pending()
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
