"""tensorplay_mpi.testing: collective verdicts, uneven patterns, launches, debug mode in tests."""

import numpy as np
import pytest
from toys import AllReducer

from tensorplay_mpi import CollectiveMismatchError, Join, JoinHook
from tensorplay_mpi.comm import iallreduce
from tensorplay_mpi.settings import settings
from tensorplay_mpi.testing import (PATTERNS, active_counts, assert_all, inputs_of,
                                    raises_everywhere, run_at_sizes)


def test_active_counts_and_patterns():
    assert active_counts([0, 2, 3]) == [2, 2, 1]
    assert active_counts([]) == [] and active_counts([0, 0]) == []
    assert inputs_of("three_plus_rank", 3) == [3, 4, 5]
    assert inputs_of("rank0_zero", 3)[0] == 0 and inputs_of("last_zero", 3)[-1] == 0
    assert set(PATTERNS) >= {"even", "three_plus_rank", "rank0_zero", "last_zero"}
    with pytest.raises(ValueError, match="pattern must be one of .* got 'odd'"):
        inputs_of("odd", 2)


def test_run_at_sizes_names_the_size_that_failed():
    code = "from mpi4py import MPI; assert MPI.COMM_WORLD.size < 2, 'too many ranks'"
    with pytest.raises(AssertionError, match=r"(?s)failed at 2 rank\(s\).*too many ranks"):
        run_at_sizes(["-c", code], sizes=(1, 2), timeout=60)


def test_debug_mode_is_on_in_tests():
    assert settings().debug


@pytest.mark.mpi
def test_raises_everywhere_passes_when_every_rank_raises(comm):
    with raises_everywhere(ValueError, match="bad") as raised:
        raise ValueError(f"bad value on rank {comm.rank}")
    assert_all(str(raised.value) == f"bad value on rank {comm.rank}", repr(raised.value))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("rank1_raises, detail", [
    (None, "rank 1: raised nothing, expected ValueError"),
    (TypeError, "rank 1: raised TypeError: boom (expected ValueError)"),
    (ValueError, "rank 1: ValueError 'boom' does not match 'bad'"),
])
def test_raises_everywhere_fails_on_every_rank_naming_the_odd_rank(comm, rank1_raises, detail):
    with pytest.raises(AssertionError) as failed:
        with raises_everywhere(ValueError, match="bad"):
            if comm.rank != 1:
                raise ValueError("bad")
            if rank1_raises is not None:
                raise rank1_raises("boom")
    expected = detail if comm.rank == 1 else (
        f"rank {comm.rank}: test verdict failed on rank(s) [1] (rank 1: AssertionError: "
        f"{detail.removeprefix('rank 1: ')})")
    assert_all(str(failed.value) == expected, str(failed.value))


class Reducer(AllReducer):
    """Reduces `count` values per input; its hook shadows `shadow_count` values."""

    def __init__(self, comm, count, shadow_count):
        super().__init__(comm)
        self.count, self.shadow_count = count, shadow_count

    def __call__(self):
        Join.notify_join_context(self)
        self.reduce(self.count)

    def reduce(self, count):
        iallreduce(self.comm, np.ones(count), np.empty(count)).wait()

    def join_hook(self, **kwargs):
        reducer = self

        class Shadow(JoinHook):
            def main_hook(self):
                reducer.reduce(reducer.shadow_count)

        return Shadow()


@pytest.mark.mpi(min_size=2)
def test_a_hook_that_does_not_shadow_fails_on_every_rank(comm):
    """Debug mode, on in tests, turns a wrong shadow (2 values for 3) into a clear error."""
    reducer = Reducer(comm, count=3, shadow_count=2)
    with raises_everywhere(CollectiveMismatchError, match="different collectives"):
        with Join([reducer]):
            for _ in range(1 + comm.rank):
                reducer()
