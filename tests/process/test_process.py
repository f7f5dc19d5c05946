"""The process set-up (one call) and testing.reset_process_state() (all of its state)."""

import sys

import numpy as np
import pytest
from helpers import PROGRAMS, results
from mpi4py import MPI

from tensorplay_mpi import (SGD, exit_for_requeue, request_save, request_stop, save_requested,
                            stop_requested)
from tensorplay_mpi import _resets
from tensorplay_mpi._process import set_up
from tensorplay_mpi._resets import register, reset_all
from tensorplay_mpi._threads import decision, limit_threads
from tensorplay_mpi.comm import iallreduce
from tensorplay_mpi.settings import settings
from tensorplay_mpi.testing import (reset_between_tests, reset_process_state, reset_settings,
                                    run_mpi)


def test_reset_process_state_makes_the_next_call_decide_again(monkeypatch):
    monkeypatch.setenv("TENSORPLAY_MPI_THREADS", "keep")
    monkeypatch.setenv("TENSORPLAY_MPI_TIMEOUT", "7")
    reset_process_state()
    set_up()
    assert settings().timeout == 7 and decision() == "kept (TENSORPLAY_MPI_THREADS=keep)"
    request_stop("test")
    monkeypatch.setenv("TENSORPLAY_MPI_TIMEOUT", "9")
    reset_process_state()
    assert stop_requested() is None
    assert decision().startswith("not decided yet")
    assert settings().timeout == 9


def test_reset_process_state_refuses_while_an_operation_is_pending():
    reset_process_state()
    timeout_before = settings().timeout
    work = iallreduce(MPI.COMM_SELF, np.ones(2), np.empty(2), MPI.SUM, "pending")
    try:
        with pytest.raises(RuntimeError, match=r"1 library operation\(s\) still pending"):
            reset_process_state()
        assert settings().timeout == timeout_before  # nothing was reset
    finally:
        work.wait()
    reset_process_state()


def test_the_thread_limit_follows_the_setting_it_is_given(monkeypatch):
    monkeypatch.setenv("TENSORPLAY_MPI_THREADS", "keep")
    reset_process_state()
    limit_threads(setting="keep")
    assert decision() == "kept (TENSORPLAY_MPI_THREADS=keep)"
    reset_process_state()


def test_a_singleton_launch_of_several_tasks_is_refused_by_the_set_up(monkeypatch):
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    with pytest.raises(RuntimeError, match="SLURM_STEP_NUM_TASKS=4: every task started as a "
                                           "singleton MPI job"):
        SGD([np.zeros(2)], [np.zeros(2)], lr=0.1)  # an optimizer sets the process up too


def test_a_bad_setting_is_refused_by_the_set_up_before_anything_starts(monkeypatch):
    monkeypatch.setenv("TENSORPLAY_MPI_THREADS", "two")
    reset_process_state()
    with pytest.raises(ValueError, match="TENSORPLAY_MPI_THREADS must be keep or a positive "
                                         "integer, got 'two'"):
        set_up()
    monkeypatch.delenv("TENSORPLAY_MPI_THREADS")
    reset_process_state()


def test_the_library_leaves_sys_exit_alone():
    exit_ = sys.exit
    set_up(MPI.COMM_WORLD)
    assert sys.exit is exit_


def test_the_scopes_reset_only_their_own_state(monkeypatch):
    monkeypatch.setenv("TENSORPLAY_MPI_THREADS", "keep")
    reset_process_state()
    set_up()
    request_stop("test")
    request_save("test")
    monkeypatch.setenv("TENSORPLAY_MPI_TIMEOUT", "11")
    reset_settings()  # the environment's decisions only
    assert settings().timeout == 11 and stop_requested() == "test"
    assert decision() == "kept (TENSORPLAY_MPI_THREADS=keep)"  # the process scope stays
    reset_between_tests()  # and the requests
    assert stop_requested() is None and save_requested() is None
    assert decision() == "kept (TENSORPLAY_MPI_THREADS=keep)"


@pytest.mark.parametrize("scopes, error", [("everything", ValueError), (["setting"], ValueError),
                                            (None, TypeError)])
def test_an_unknown_scope_is_refused(scopes, error):
    with pytest.raises(error):
        reset_all(scopes)


def test_one_scope_may_be_named_alone():
    request_stop("test")
    reset_all("requests")
    assert stop_requested() is None


_cleared = []


def _clear_test_state():
    _cleared.append(True)


def test_a_reset_registers_itself_under_its_module_and_name(monkeypatch):
    monkeypatch.setattr(_resets, "_registered", list(_resets.registered()))
    register(_clear_test_state, "requests")
    register(_cleared.clear, "settings")
    *_, first, second = _resets.registered()
    assert (first.module, first.name, first.scope) == (__name__, "_clear_test_state", "requests")
    assert (second.module, second.name, second.scope) == (__name__, "_cleared.clear", "settings")
    reset_all("requests")
    assert _cleared == [True]
    reset_all("settings")
    assert _cleared == []
    with pytest.raises(ValueError, match="unknown scope"):
        register(_clear_test_state, "everything")


# -- how a job ends: one clear message per rank -------------------------------------------------

QUIET_EXIT = str(PROGRAMS / "quiet_exit.py")
THREAD_NOTE = "tensorplay_mpi: BLAS/OpenMP threads limited"


@pytest.mark.parametrize("nprocs", [2, 3])
def test_a_stop_ended_as_the_docs_say_prints_nothing_but_its_results(nprocs):
    """``exit_for_requeue()`` (docs/stopping.md: MPI finalized, then status 75): the library's
    persistent requests are freed before MPI finalizes (MPICH printed a "freeing inactive persistent
    request" line for each one left)."""
    result = run_mpi(nprocs, [QUIET_EXIT, "stop"], timeout=90)
    assert result.returncode == 75, (result.stdout, result.stderr)
    assert sorted(results(result.stdout)) == list(range(nprocs)), result.stdout
    noise = [line for line in result.stderr.splitlines() if not line.startswith(THREAD_NOTE)]
    assert noise == [], result.stderr


@pytest.mark.parametrize("nprocs", [2, 3])
def test_an_exception_in_one_ranks_loop_prints_one_error_per_rank(nprocs):
    """Rank 1 raises, uncaught (``python -m mpi4py`` then aborts the job), and the others a
    PeerFailureError: each rank's traceback, once, and no report from an exit hook of the
    operations that the failure left pending (it is the same failure).  The ranks' lines may
    interleave in the job's output: the checks count whole writes, not lines."""
    result = run_mpi(nprocs, [QUIET_EXIT, "raise"], timeout=90)
    assert result.returncode != 0, (result.stdout, result.stderr)
    assert result.stderr.count("Traceback (most recent call last):") == nprocs, result.stderr
    for rank in set(range(nprocs)) - {1}:
        assert f"rank {rank}: rank 1 failed with ValueError: boom in iteration 3" \
            in result.stderr, result.stderr
    for noise in ("RuntimeError", "Exception ignored", "freeing inactive persistent request"):
        assert noise not in result.stderr, result.stderr


@pytest.mark.parametrize("status, error", [("75", TypeError), (75.0, TypeError),
                                           (True, TypeError), (256, ValueError),
                                           (-1, ValueError)])
def test_exit_for_requeue_refuses_a_status_that_is_none(status, error):
    """A status read from the environment ("75") would exit 1, 256 would exit 0: refused,
    before MPI is finalized."""
    with pytest.raises(error, match="exit_for_requeue"):
        exit_for_requeue(status)
