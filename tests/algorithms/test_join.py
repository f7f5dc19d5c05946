"""The Join API: serial tests (one rank, the plugin's `comm`) of its contract and user errors;
under mpiexec, the join protocol: exact totals, rounds and post hooks for uneven inputs."""

import time
import warnings

import numpy as np
import pytest
from mpi4py import MPI
from toys import AFTER_CONSTANT, AllReducer, NoInit, run

from tensorplay_mpi import EarlyTerminationError, Join, Joinable, JoinHook, Work
from tensorplay_mpi.algorithms import join as join_module
from tensorplay_mpi.comm import iallreduce
from tensorplay_mpi.testing import PATTERNS, active_counts, assert_all, inputs_of, raises_everywhere

def test_public_names_import_from_both_places():
    assert join_module.Join is Join
    assert join_module.Joinable is Joinable
    assert join_module.JoinHook is JoinHook


def test_join_hook_defaults_are_no_ops():
    hook = JoinHook()
    assert hook.main_hook() is None
    assert hook.post_hook(True) is None


def test_joinable_is_abstract():
    with pytest.raises(TypeError):
        Joinable()


def test_single_rank_run_is_its_own_last_joiner(comm):
    joinable = AllReducer(comm, num_allreduces=2)
    with Join([joinable]) as join:
        assert isinstance(join, Join)
        total = sum(joinable() for _ in range(3))
    assert total == 6
    assert [w.result() for w in joinable.heartbeats] == [1, 1, 1]
    assert all(isinstance(w, Work) and w.is_completed() for w in joinable.heartbeats)
    assert (joinable.main_rounds, joinable.post_hooks) == (0, [True])


def test_hooks_are_built_in_init_with_every_kwarg(comm):
    joinables = [AllReducer(comm), AllReducer(comm)]
    Join(joinables, alpha=1, beta="b")
    assert [j.hook_kwargs for j in joinables] == [{"alpha": 1, "beta": "b"}] * 2


def test_notify_outside_the_block_returns_none(comm):
    joinable = AllReducer(comm)
    join = Join([joinable])
    with pytest.raises(RuntimeError, match="never entered.*`with Join"):
        Join.notify_join_context(joinable)  # built but not entered: a forgotten `with`
    assert Join.notify_join_context(joinable) is None  # said once
    with join:
        assert isinstance(Join.notify_join_context(joinable), Work)
    assert Join.notify_join_context(joinable) is None  # configs reset on exit


def test_configs_are_reset_after_an_exception(comm):
    joinable = AllReducer(comm)
    with pytest.raises(KeyError):
        with Join([joinable]):
            joinable()
            raise KeyError("in the block")
    assert Join.notify_join_context(joinable) is None
    assert (joinable.main_rounds, joinable.post_hooks) == (0, [])


def test_only_the_first_joinable_sends_heartbeats(comm):
    first, second = AllReducer(comm), AllReducer(comm)
    with Join([first, second]):
        assert Join.notify_join_context(second) is None
        assert isinstance(Join.notify_join_context(first), Work)


def test_disabled_join_sends_nothing_and_runs_no_hook(comm):
    joinable = AllReducer(comm)
    with Join([joinable], enable=False):
        assert Join.notify_join_context(joinable) is None
    assert joinable.post_hooks == []


def test_warning_filters_are_untouched(comm):
    before = list(warnings.filters)
    joinable = AllReducer(comm)
    with Join([joinable]):
        joinable()
    assert warnings.filters == before


def test_empty_joinables_is_a_value_error():
    with pytest.raises(ValueError, match="at least one joinable"):
        Join([])


def test_non_joinable_is_a_type_error(comm):
    with pytest.raises(TypeError, match="Joinable objects, got int"):
        Join([AllReducer(comm), 3])


def test_duplicate_joinable_is_a_value_error(comm):
    joinable = AllReducer(comm)
    with pytest.raises(ValueError, match="more than once"):
        Join([joinable, joinable])


def test_joinables_on_different_communicators_is_a_value_error(comm):
    with pytest.raises(ValueError, match="same communicator"):
        Join([AllReducer(comm), AllReducer(MPI.COMM_SELF)])


def test_a_communicator_that_is_not_an_intracomm_is_a_type_error():
    with pytest.raises(TypeError, match="Intracomm"):
        Join([AllReducer("not a communicator")])


def test_comm_null_is_a_value_error():
    with pytest.raises(ValueError, match="COMM_NULL"):
        Join([AllReducer(MPI.COMM_NULL)])


def test_skipped_joinable_init_names_the_constructor(comm):
    with pytest.raises(TypeError, match=r"NoInit does not call the Joinable constructor"):
        Join([NoInit(comm)])
    with pytest.raises(TypeError, match=r"super\(\).__init__\(\)"):
        Join.notify_join_context(NoInit(comm))


def test_bad_join_device_is_a_value_error(comm):
    class OnTpu(AllReducer):
        join_device = "tpu:0"

    with pytest.raises(ValueError, match="OnTpu.join_device must be .*'tpu:0'"):
        Join([OnTpu(comm)])
    with pytest.raises(ValueError, match="OnTpu.join_device"):  # not only the first one's
        Join([AllReducer(comm), OnTpu(comm)])


def test_a_join_is_single_use(comm):
    join = Join([AllReducer(comm)])
    with join:
        pass
    with pytest.raises(RuntimeError, match="single-use"):
        with join:
            pass


def test_two_active_joins_cannot_share_a_joinable(comm):
    joinable = AllReducer(comm)
    with Join([joinable]):
        with pytest.raises(RuntimeError, match="already in an active Join"):
            with Join([joinable]):
                pass
        assert isinstance(Join.notify_join_context(joinable), Work)  # the outer one still works


def test_work_result_and_negative_timeout(comm):
    joinable = AllReducer(comm)
    with Join([joinable]):
        work = Join.notify_join_context(joinable)
        assert work.wait(timeout=5.0) is True
        assert work.result() == 1
        with pytest.raises(ValueError, match="timeout"):
            Join.notify_join_context(joinable).wait(timeout=-1)


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf")])
def test_a_timeout_must_be_positive_and_finite(comm, timeout):
    with pytest.raises(ValueError, match="timeout must be a positive, finite number"):
        Join([AllReducer(comm)], timeout=timeout)


@pytest.mark.parametrize("timeout", ["5", True, [5]])
def test_a_timeout_that_is_no_number_is_a_type_error(comm, timeout):
    with pytest.raises(TypeError, match="timeout must be a number of seconds"):
        Join([AllReducer(comm)], timeout=timeout)


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1])
def test_work_wait_refuses_a_timeout_that_never_or_already_ended(comm, timeout):
    work = iallreduce(comm, np.ones(1), np.empty(1))
    with pytest.raises(ValueError, match="finite number >= 0"):
        work.wait(timeout)
    work.wait()


# -- under mpiexec at any rank count (@pytest.mark.mpi) --------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("num_joinables", [1, 2])
@pytest.mark.parametrize("num_allreduces", [0, 1, 3])
def test_exact_totals_rounds_and_post_hooks(comm, pattern, num_joinables, num_allreduces):
    inputs = inputs_of(pattern, comm.size)
    mine, longest = inputs[comm.rank], max(inputs)
    joinables = [AllReducer(comm, num_allreduces) for _ in range(num_joinables)]
    total = run(joinables, mine)

    active = active_counts(inputs)
    expected_total = num_joinables * num_allreduces * sum(active[:mine])
    first, others = joinables[0], joinables[1:]
    heartbeats = [w.result() for w in first.heartbeats]
    assert_all(total == expected_total, f"total {total} != {expected_total}")
    assert_all(heartbeats == active[:mine], f"heartbeat counts {heartbeats} != {active[:mine]}")
    assert_all(all(w is None for j in others for w in j.heartbeats),
               "only the first joinable may send heartbeats")
    rounds = [j.main_rounds for j in joinables]
    assert_all(rounds == [longest - mine] * num_joinables,
               f"main-hook rounds {rounds} != {longest - mine}")
    posts = [j.post_hooks for j in joinables]
    assert_all(posts == [[mine == longest]] * num_joinables, f"post hooks {posts}")
    notified = [j.notify_in_hook for j in joinables if j.main_rounds]
    assert_all(all(n is None for n in notified), f"notify in a hook gave {notified}")


@pytest.mark.mpi
@pytest.mark.parametrize("keep_heartbeat", [True, False])
def test_post_hooks_agree_on_a_last_joiner(comm, keep_heartbeat):
    joinables = [AllReducer(comm), AllReducer(comm)]
    with Join(joinables, run_post_hooks=True):
        for _ in range(3 + comm.rank):
            for joinable in joinables:
                joinable(keep_heartbeat=keep_heartbeat)
    values = [j.post_hook_value for j in joinables]
    assert_all(values == [AFTER_CONSTANT] * 2, f"post hook values {values}")


@pytest.mark.mpi
def test_kwargs_reach_every_hook(comm):
    joinables = [AllReducer(comm, num_allreduces=2) for _ in range(2)]
    total = run(joinables, 3 + comm.rank, num_allreduces=2, run_post_hooks=True, tag="x")
    size = comm.size
    expected = 2 * 2 * sum(active_counts([3 + r for r in range(size)])[: 3 + comm.rank])
    kwargs = [j.hook_kwargs for j in joinables]
    assert_all(kwargs == [{"num_allreduces": 2, "run_post_hooks": True, "tag": "x"}] * 2,
               f"hook kwargs {kwargs}")
    assert_all(total == expected, f"total {total} != {expected}")


@pytest.mark.mpi
@pytest.mark.parametrize("num_joinables", [1, 2])
def test_disabled_join_is_inert(comm, num_joinables):
    joinables = [AllReducer(comm) for _ in range(num_joinables)]
    total = run(joinables, 4, enable=False)
    heartbeats = [w for j in joinables for w in j.heartbeats]
    assert_all(total == 4 * comm.size * num_joinables, f"total {total}")
    assert_all(heartbeats == [None] * 4 * num_joinables, "a disabled Join sent a heartbeat")
    hooks = [(j.main_rounds, j.post_hooks) for j in joinables]
    assert_all(hooks == [(0, [])] * num_joinables, f"a disabled Join ran hooks: {hooks}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("num_joinables", [1, 2])
def test_throw_on_early_termination_raises_on_every_rank(comm, num_joinables):
    joinables = [AllReducer(comm) for _ in range(num_joinables)]
    message = None
    try:
        run(joinables, 3 + comm.rank, throw_on_early_termination=True)
    except EarlyTerminationError as exc:  # a RuntimeError, as PyTorch's code expects
        message = str(exc) if isinstance(exc, RuntimeError) else "not a RuntimeError"
    expected = ("Rank 0 exhausted all inputs." if comm.rank == 0 else
                "Detected at least one rank that exhausted inputs. Throwing across all ranks.")
    assert_all(message == expected, f"raised {message!r}")
    hooks = [(j.main_rounds, j.post_hooks) for j in joinables]
    assert_all(hooks == [(0, [])] * num_joinables, f"hooks ran in throw mode: {hooks}")
    # the communicator is still usable and nothing leaks into the next Join
    total = run([AllReducer(comm)], 2 + comm.rank)
    expected_total = sum(active_counts([2 + r for r in range(comm.size)])[: 2 + comm.rank])
    assert_all(total == expected_total, f"next Join total {total} != {expected_total}")


@pytest.mark.mpi
def test_throw_mode_with_even_inputs_does_not_throw(comm):
    total = run([AllReducer(comm)], 3, throw_on_early_termination=True)
    assert_all(total == 3 * comm.size, f"total {total}")


@pytest.mark.mpi
def test_exception_in_block_propagates_without_hooks_and_next_join_works(comm):
    joinable = AllReducer(comm)
    caught = None
    try:
        with Join([joinable]):
            for i in range(5):
                joinable()
                if i == 2:
                    raise ValueError("boom")
    except ValueError as exc:
        caught = exc
    assert_all(str(caught) == "boom", f"caught {caught!r}")
    assert_all((joinable.main_rounds, joinable.post_hooks) == (0, []), "hooks ran")
    after = AllReducer(comm)
    total = run([after], 1 + comm.rank)
    expected = sum(active_counts([1 + r for r in range(comm.size)])[: 1 + comm.rank])
    assert_all(total == expected, f"next Join total {total} != {expected}")


@pytest.mark.mpi
@pytest.mark.parametrize("rounds, warns", [(1000, False), (1001, True)])
def test_skew_warning_once_after_1000_rounds_and_filters_untouched(comm, rounds, warns):
    mine = 0 if comm.rank == 0 else rounds
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filters_before = list(warnings.filters)
        run([AllReducer(comm, num_allreduces=0)], mine)
        filters_after = list(warnings.filters)
    skew = [w for w in caught if "uneven input skew" in str(w.message)]
    expected = 1 if (warns and comm.rank == 0 and comm.size > 1) else 0
    assert_all(len(skew) == expected, f"{len(skew)} skew warnings, expected {expected}")
    assert_all(all(w.category is UserWarning for w in skew), "skew warning is not a UserWarning")
    assert_all(filters_before == filters_after, "Join changed the global warning filters")


@pytest.mark.mpi(min_size=2)
def test_work_wait_timeout_leaves_the_request_pending(comm):
    buf = np.array([1], dtype=np.int64)
    timed_out = premature = False
    if comm.rank == 1:
        time.sleep(0.5)  # rank 0 starts first and cannot complete yet
    work = iallreduce(comm, np.ones(1, np.int64), buf)
    if comm.rank == 0:
        try:
            work.result()
        except RuntimeError:
            premature = True
        try:
            work.wait(timeout=0.05)
        except TimeoutError:
            timed_out = True
    work.wait()
    assert_all(comm.rank != 0 or (timed_out and premature), f"{timed_out=} {premature=}")
    assert_all(work.is_completed() and buf[0] == comm.size, f"result {buf[0]}")


@pytest.mark.mpi
def test_exit_for_requeue_inside_a_join_raises_on_every_rank(comm):
    """MPI cannot be finalized under a running Join's operations: a RuntimeError, not an exit
    whose status MPICH's errors would replace."""
    from tensorplay_mpi import exit_for_requeue
    with Join([AllReducer(comm)]):
        with raises_everywhere(RuntimeError, match="after the `with Join"):
            exit_for_requeue()
