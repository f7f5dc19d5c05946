"""JoinableComm misused: the same clear error on every rank, whether or not a rank has joined."""


import numpy as np
import pytest
from helpers import PROGRAMS, HostSubclass, results, rss_bytes
from mpi4py import MPI
from toys import AllReducer

from tensorplay_mpi import CollectiveMismatchError, Join, JoinableComm
from tensorplay_mpi.algorithms._announcements import SLOTS, decode
from tensorplay_mpi.comm._digests import ints_digest
from tensorplay_mpi.testing import assert_all, raises_everywhere, reset_settings, run_mpi

PROGRAM = str(PROGRAMS / "jc_misuse.py")
MODES = ["every rank active", "rank 0 joined"]


def run_loop(comm, mode, body):
    """`body(jc)` once per iteration: outside a Join, or in a Join where rank 0 has no inputs."""
    jc = JoinableComm(comm)
    if mode == "every rank active":
        return body(jc)
    with Join([jc]):
        for _ in range(0 if comm.rank == 0 else 1):
            jc.begin_iteration()
            return body(jc)


def error_of(fn):
    try:
        fn()
    except Exception as exc:
        return exc
    return None


@pytest.mark.mpi
@pytest.mark.parametrize("join", ["none", "disabled"])
def test_outside_an_enabled_join_nothing_is_retained(comm, join):
    jc = JoinableComm(comm)
    x = np.ones(2**17)  # 1 MiB

    def loop(n):
        for _ in range(n):
            jc.allreduce(x)  # a fresh 1 MiB result each time
            jc.iallreduce(x).wait()

    loop(50)  # warm-up: allocator pools, MPI buffers
    before = rss_bytes()
    if join == "none":
        loop(500)
    else:
        with Join([jc], enable=False):
            loop(500)
    growth = rss_bytes() - before
    assert_all(growth < 16 * 2**20, f"resident memory grew by {growth / 2**20:.1f} MiB")


@pytest.mark.mpi(min_size=2)
def test_any_number_of_dimensions_with_and_without_joined_ranks(comm):
    x = np.full((1,) * 11 + (2,), float(comm.rank + 1))  # 12-d
    got = []
    with Join([JoinableComm(comm)]) as join:
        jc = join.joinables[0]
        for _ in range(1 if comm.rank == 0 else 2):  # iteration 2 without rank 0
            jc.begin_iteration()
            got.append(jc.allreduce(x))
    everyone = sum(range(1, comm.size + 1))
    expected = [everyone, everyone - 1][:len(got)]
    ok = all(g.shape == x.shape and (g == e).all() for g, e in zip(got, expected))
    assert_all(ok, f"{[g.ravel()[0] for g in got]} != {expected}")


def _mismatched_rows(comm, what):
    last = comm.rank == comm.size - 1
    if what == "trailing dimensions":
        return np.ones((1, 3 if last else 2))
    return np.ones((1, 2), np.float32 if last else np.float64)


@pytest.mark.mpi(min_size=3)  # two active ranks that differ, with rank 0 joined
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("what", ["trailing dimensions", "dtype"])
def test_allgather_rows_that_differ_raise_the_same_error_on_every_rank(comm, mode, what):
    error = error_of(lambda: run_loop(comm, mode, lambda jc: jc.allgather(
        _mismatched_rows(comm, what))))
    assert_all(isinstance(error, ValueError) and "same trailing dimensions" in str(error),
               repr(error))
    gathered = run_loop(comm, "every rank active", lambda jc: jc.allgather(np.ones((1, 2))))
    assert_all(gathered.shape == (comm.size, 2), f"afterwards: {gathered.shape}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("root, kind", [(True, TypeError), (np.True_, TypeError),
                                        (0.5, TypeError), (-1, ValueError), (99, ValueError)])
def test_bad_bcast_roots_raise_the_same_error_on_every_rank(comm, mode, root, kind):
    error = error_of(lambda: run_loop(comm, mode, lambda jc: jc.bcast(np.ones(2), root=root)))
    assert_all(type(error) is kind, repr(error))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
def test_in_place_allreduce_and_bcast(comm, mode):
    x = np.full(3, comm.rank + 1.0)
    y = np.full(2, float(comm.rank))

    def body(jc):
        return jc.allreduce(x, MPI.MAX, out=x), jc.bcast(y, out=y)

    got = run_loop(comm, mode, body)
    if got is not None:  # None on a joined rank
        total, top = got
        ok = total is x and top is y and (x == comm.size).all() and (y == comm.size - 1).all()
        assert_all(ok, f"{x} {y}")
    else:
        assert_all(True)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", [np.ndarray, HostSubclass])
@pytest.mark.parametrize("n", [4, 100_000])  # persistent or nonblocking
def test_an_overlapping_out_is_a_value_error(comm, kind, n):
    x = np.ones(n + 1)
    error = error_of(lambda: JoinableComm(comm).allreduce(x[:n], out=x[1:].view(kind)))
    assert_all(isinstance(error, ValueError) and "out=x" in str(error), repr(error))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["allreduce", "bcast", "allreduce out=x"])
@pytest.mark.parametrize("n", [4, 100_000])
def test_a_read_only_out_is_a_value_error_before_any_collective(comm, op, n):
    jc, x, out = JoinableComm(comm), np.ones(n), np.zeros(n)
    out.flags.writeable = False
    with raises_everywhere(ValueError, match="out is read-only"):
        if op == "allreduce":
            jc.allreduce(x, out=out)
        elif op == "bcast":
            jc.bcast(x, root=0, out=out)
        else:
            jc.allreduce(out, out=out)
    total = jc.allreduce(np.ones(2))  # nothing started: the communicator works on
    assert_all(np.array_equal(total, np.full(2, comm.size)), f"allreduce gave {total}")


@pytest.mark.mpi(min_size=3)
def test_active_ranks_announcing_different_operations_raise_on_every_rank(comm):
    error = error_of(lambda: run_loop(comm, "rank 0 joined",
                                      lambda jc: jc.allreduce(np.ones(comm.rank))))
    assert_all(isinstance(error, RuntimeError) and "not one operation" in str(error), repr(error))
    jc = JoinableComm(comm)
    with Join([jc]):  # the communicator is still usable
        for _ in range(comm.rank):
            jc.begin_iteration()
            jc.allreduce(np.ones(1))


@pytest.mark.parametrize("nprocs", [2, 3])
def test_an_operation_inside_dp_step_with_a_joined_rank_is_ordered_by_the_stream(nprocs):
    """Once refused (a joined rank's DataParallel hook met the announcement): the stream now
    orders the step and the operation, and both give the right numbers."""
    result = run_mpi(nprocs, [PROGRAM], timeout=60)
    outcomes = results(result.stdout)
    assert result.returncode == 0, (result.stdout, result.stderr)
    assert len(outcomes) == nprocs and set(outcomes.values()) == {"ok"}, result.stdout


@pytest.mark.parametrize("fields, message", [
    ((2, 1, 99, -1, 3, 0), "is invalid"),  # an allreduce of dtype code 99
    ((2, 0, 12, -1, 3, 0), "is invalid"),  # an allreduce without an op
    ((7, 0, 0, -1, 0, 0), "is invalid"),  # no such kind
    ((4, 0, 12, 5, 3, 0), "is invalid"),  # a bcast root beyond the communicator
    (None, "not one operation"),  # no announcement at all: a gradient bucket, say
])
def test_a_joined_rank_checks_what_it_receives(fields, message):
    if fields is None:
        received = np.arange(SLOTS, dtype=np.float64).view(np.int64)
    else:
        signature = ints_digest(fields)
        received = np.array(fields + (signature, -signature, 0, 0) + (0,) * (SLOTS - 10))
    with pytest.raises(RuntimeError, match=message):
        decode(received, 1, "the announcement")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype, op", [(np.bool_, MPI.MAX), (np.float64, MPI.BAND),
                                       (np.complex128, MPI.MIN)])
@pytest.mark.parametrize("joined", [False, True])
def test_an_op_mpi_does_not_define_on_the_dtype_is_a_type_error_in_both_modes(
        comm, dtype, op, joined):
    jc = JoinableComm(comm)
    # active ranks name the op and dtype; a joined rank learns the kind from the announcement
    with raises_everywhere(TypeError, match=r"does not apply to dtype|had a bad argument"):
        with Join([jc]):
            for i in range(2 if joined and comm.rank == 0 else 3):  # rank 0 joins: or not
                jc.begin_iteration()
                bad = i == 2
                jc.allreduce(np.ones(2, dtype if bad else np.float64), op=op if bad else MPI.SUM)
    with Join([jc]):  # the communicator stays usable
        jc.begin_iteration()
        total = jc.allreduce(np.ones(1))
    assert_all(total[0] == comm.size, f"total {total}")


@pytest.mark.mpi(min_size=2)
def test_two_joinable_comms_in_one_join_are_refused_and_the_first_still_works(comm):
    """Two JoinableComms on one communicator would interleave their announcements (a joined
    rank's shadow waited until the timeout): the Join is refused on every rank, and no joinable
    is left marked as made into a Join that was never entered."""
    first, second, before = JoinableComm(comm), JoinableComm(comm), AllReducer(comm)
    with raises_everywhere(ValueError, match="at most one JoinableComm, got 2"):
        Join([before, first, second])
    outside = before()  # outside a Join: no "a Join was made ... but never entered"
    assert_all(outside == comm.size, f"outside a Join: {outside}")
    Join([before])  # made, never entered: a refused Join must not hide that
    with raises_everywhere(ValueError, match="at most one JoinableComm"):
        Join([before, first, second])
    with raises_everywhere(RuntimeError, match="never entered"):
        before()
    iterations = 1 if comm.rank == 0 else 3  # rank 0 joins early
    with Join([first]):
        for _ in range(iterations):
            first.begin_iteration()
            total = first.allreduce(np.ones(2))
    assert_all(np.array_equal(total, np.full(2, comm.size - (comm.rank != 0))),
               f"the last allreduce gave {total}")


MISMATCHES = {  # rank r's call in the mismatched iteration: odd and even active ranks differ
    "dtype": lambda jc, r: jc.allreduce(np.ones(4, np.float32 if r % 2 else np.float64)),
    "element count": lambda jc, r: jc.allreduce(np.ones(4 + r % 2)),
    "op": lambda jc, r: jc.allreduce(np.ones(4), MPI.MAX if r % 2 else MPI.SUM),
    "op of a carried MAX": lambda jc, r: jc.allreduce(np.ones(2, np.int64),
                                                      MPI.MIN if r % 2 else MPI.MAX),
    "float MAX against int MAX": lambda jc, r: jc.allreduce(
        np.ones(2, np.float64 if r % 2 else np.int64), MPI.MAX),
    "root": lambda jc, r: jc.bcast(np.full(4, float(r)), root=r % 2),
    "root of a large bcast": lambda jc, r: jc.bcast(np.ones(1000), root=r % 2),
    "kind": lambda jc, r: jc.bcast(np.ones(4)) if r % 2 else jc.allreduce(np.ones(4)),
    "allgather against allreduce": lambda jc, r: (jc.allgather(np.ones((2, 4))) if r % 2
                                                  else jc.allreduce(np.ones(8))),
    "large element count": lambda jc, r: jc.allreduce(np.ones(100_000 + r % 2)),
    "a SUM in slots against a larger one": lambda jc, r: jc.allreduce(np.ones(2 + 38 * (r % 2))),
}
PATHS = ["outside a Join", "every rank active", "rank 0 joined"]


@pytest.fixture
def default_settings(monkeypatch):
    """The library as users run it: without the test plugin's debug mode (whose signature
    checks would catch a mismatch on their own)."""
    monkeypatch.setenv("TENSORPLAY_MPI_DEBUG", "0")
    reset_settings()
    yield
    monkeypatch.undo()
    reset_settings()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mismatch", MISMATCHES)
def test_calls_that_differ_between_ranks_raise_everywhere_and_return_nothing(
        default_settings, comm, mismatch, path):
    """Default settings: a call whose kind, dtype, element count, op or root differs between
    active ranks raises CollectiveMismatchError on every rank, joined ones included, in the
    third iteration as in the first, on the persistent, plain and announced paths; no rank
    gets a value (raw MPI would return garbage, or hang)."""
    if path == "rank 0 joined" and comm.size < 3:
        pytest.skip("two active ranks must differ while rank 0 has joined: needs 3 ranks")
    jc, call = JoinableComm(comm), MISMATCHES[mismatch]
    returned = []

    def iteration(t):
        good = jc.allreduce(np.ones(3))  # the same on every rank: fine
        assert np.array_equal(good, np.full(3, float(active))), good
        if t == 2:
            returned.append(call(jc, comm.rank))

    active = comm.size - (path == "rank 0 joined")
    with raises_everywhere(CollectiveMismatchError):
        if path == "outside a Join":
            for t in range(3):
                iteration(t)
        else:
            with Join([jc]):
                for t in range(3 if comm.rank or path == "every rank active" else 0):
                    jc.begin_iteration()
                    iteration(t)
    assert_all(not returned, f"a mismatched call returned {returned}")


@pytest.mark.mpi(min_size=2)
def test_a_bad_argument_on_one_rank_raises_there_and_is_a_mismatch_elsewhere(
        default_settings, comm):
    """Rank 0 passes a bad op; the others a good call: rank 0 raises its TypeError, the others
    CollectiveMismatchError (they cannot know the argument), none hangs."""
    jc = JoinableComm(comm)
    with raises_everywhere(TypeError if comm.rank == 0 else CollectiveMismatchError):
        with Join([jc]):
            for _ in range(2):
                jc.begin_iteration()
                jc.allreduce(np.ones(4), "SUM" if comm.rank == 0 else MPI.SUM)


@pytest.mark.mpi(min_size=3)
def test_allgather_rows_that_differ_name_the_active_rank_that_differs(comm):
    """Rank 0 has joined (it sends no rows): the message names the last rank, whose rows differ
    from rank 1's, not rank 0."""
    jc = JoinableComm(comm)
    last = comm.size - 1
    with raises_everywhere(ValueError, match=rf"ranks \[{last}\] differ from rank 1\b"):
        with Join([jc]):
            for _ in range(1 if comm.rank else 0):
                jc.begin_iteration()
                jc.allgather(np.ones((2, 3 if comm.rank == last else 4)))
