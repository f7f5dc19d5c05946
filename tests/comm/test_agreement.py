"""The agreement: a failure on some ranks raises on every rank, of its kind, naming the ranks."""

import numpy as np
import pytest

from tensorplay_mpi.comm._agreement import KINDS, agree, kind_code
from tensorplay_mpi.comm import iallgather
from tensorplay_mpi.errors import CollectiveMismatchError
from tensorplay_mpi.testing import assert_all


def run(comm, error=None, values=(), text="", text_bytes=64):
    """agree() over `comm`; what it returned or raised."""
    try:
        return agree(lambda row, every: iallgather(comm, row, every, "the test's agreement"),
                     comm.rank, comm.size, "the test's agreement", 60, error, values, text,
                     text_bytes)
    except Exception as raised:
        return raised


@pytest.mark.parametrize("error, kind", [
    (FileNotFoundError(2, "gone"), OSError), (TypeError("t"), TypeError),
    (CollectiveMismatchError("m"), RuntimeError), (KeyError("k"), RuntimeError),
    (AssertionError("a"), AssertionError), (ValueError("v"), ValueError)])
def test_a_failure_travels_as_its_nearest_kind(error, kind):
    assert KINDS[kind_code(error) - 1] is kind


@pytest.mark.mpi
def test_without_failures_every_rank_gets_every_ranks_values_and_text(comm):
    got = run(comm, values=[comm.rank, -7 * comm.rank], text="é" * comm.rank)
    expected = np.array([[r, -7 * r] for r in range(comm.size)], dtype=np.int64)
    assert_all(not isinstance(got, Exception) and np.array_equal(got.values, expected)
               and got.texts == ["é" * r for r in range(comm.size)], repr(got))


@pytest.mark.mpi(min_size=2)
def test_a_failed_rank_raises_its_own_error_and_the_others_its_kind_naming_it(comm):
    mine = FileNotFoundError(2, "No such file", "/x") if comm.rank == 1 else None
    got = run(comm, mine, values=[comm.rank])
    if comm.rank == 1:
        ok = got is mine
    else:
        ok = type(got) is OSError and str(got) == (
            f"rank {comm.rank}: the test's agreement failed on rank(s) [1] (rank 1: "
            "FileNotFoundError: [Errno 2] No such file: '/x')")
    assert_all(ok, repr(got))


@pytest.mark.mpi(min_size=2)
def test_several_failures_are_named_and_quoted_with_the_first_ones_kind(comm):
    failing = comm.rank > 0
    mine = (ValueError if comm.rank == 1 else TypeError)(f"rank {comm.rank}: bad {comm.rank}" +
                                                          "x" * 200) if failing else None
    got = run(comm, mine)
    quoted = "; ".join(f"rank {r}: " + (f"{'ValueError' if r == 1 else 'TypeError'}: bad {r}"
                                        + "x" * 200)[:64]  # clipped to text_bytes
                       for r in range(1, min(comm.size, 4)))
    more = f"; {comm.size - 4} more" if comm.size > 4 else ""
    expected = (f"rank 0: the test's agreement failed on rank(s) {list(range(1, comm.size))} "
                f"({quoted}{more})")
    ok = got is mine if failing else type(got) is ValueError and str(got) == expected
    assert_all(ok, f"{got!r} (expected {expected!r})")
