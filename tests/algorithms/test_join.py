"""Serial tests of the Join API (one rank, the plugin's `comm`): contract, user errors."""

import warnings

import numpy as np
import pytest
from mpi4py import MPI
from toys import AllReducer, NoInit

from tensorplay_mpi import Join, Joinable, JoinHook, Work
from tensorplay_mpi.algorithms import join as join_module
from tensorplay_mpi.comm import iallreduce


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
