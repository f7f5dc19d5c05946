"""JoinableComm's kept arrays (``jc.keep``): finished ranks stay current, against NumPy.

A rank that has joined applies every result the active ranks apply to a kept array (``out=``,
``into=``), so after the Join every rank holds the same state; the expected values are
computed here with NumPy from every rank's inputs, iteration by iteration."""

import numpy as np
import pytest
from helpers import UNEVEN
from mpi4py import MPI

from tensorplay_mpi import (SGD, CollectiveMismatchError, DataParallel, Join, JoinableComm,
                            clear_save, request_save)
from tensorplay_mpi.algorithms import _elastic as elastic
from tensorplay_mpi.testing import assert_all, inputs_of, raises_everywhere


def values(rank, t, n, dtype=np.float64):
    """Rank `rank`'s values in iteration `t`: small integers (float sums are exact), NaN-free."""
    return ((np.arange(n) * 7 + rank * 5 + t * 3) % 11 - 4).astype(dtype)


def kept_state():
    """Fresh kept arrays: sums (SUM, large), maxes (MAX of 3 int64: the announcement carries
    it), mins (MIN of 4 float32: carried as ordered keys), big (MAX of 20 float64: ordered keys
    through an allreduce), latest and latest_big (bcast from the highest active rank, small
    and large), last (out= of a SUM)."""
    return {"sums": np.zeros(40), "maxes": np.full(3, -100, np.int64),
            "mins": np.full(4, 100, np.float32), "big": np.full(20, -np.inf),
            "latest": np.zeros(4), "latest_big": np.zeros(20), "last": np.zeros(5)}


def iteration(jc, kept, rank, t):
    """One iteration's operations, every result applied to a kept array."""
    jc.allreduce(values(rank, t, 40), into=kept["sums"])
    jc.allreduce(values(rank, t, 3, np.int64), MPI.MAX, into=kept["maxes"])
    jc.allreduce(values(rank, t, 4, np.float32), MPI.MIN, into=kept["mins"])
    jc.allreduce(values(rank, t, 20), MPI.MAX, into=kept["big"])
    jc.bcast(values(rank, t, 4) + 1000 * rank, root="highest_active", out=kept["latest"])
    jc.bcast(values(rank, t, 20) + 1000 * rank, out=kept["latest_big"])
    jc.allreduce(values(rank, t, 5), out=kept["last"])


def expected_state(inputs):
    """The kept arrays after the loop, with NumPy: each iteration's active ranks' values."""
    kept = kept_state()
    for t in range(max(inputs, default=0)):
        active = [r for r, n in enumerate(inputs) if n > t]
        kept["sums"] += sum(values(r, t, 40) for r in active)
        kept["maxes"] = np.maximum(kept["maxes"], np.max([values(r, t, 3, np.int64)
                                                          for r in active], axis=0))
        kept["mins"] = np.minimum(kept["mins"], np.min([values(r, t, 4, np.float32)
                                                        for r in active], axis=0))
        kept["big"] = np.maximum(kept["big"], np.max([values(r, t, 20) for r in active], axis=0))
        kept["latest"] = values(active[-1], t, 4) + 1000 * active[-1]
        kept["latest_big"] = values(active[-1], t, 20) + 1000 * active[-1]
        kept["last"] = sum(values(r, t, 5) for r in active)
    return kept


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", UNEVEN + ["even", "one_straggler"])
def test_every_rank_holds_the_final_kept_state_after_uneven_inputs(comm, pattern):
    inputs = inputs_of(pattern, comm.size)
    jc = JoinableComm(comm)
    kept = kept_state()
    jc.keep(*kept.values())
    with Join([jc]):
        for t in range(inputs[comm.rank]):
            jc.begin_iteration()
            iteration(jc, kept, comm.rank, t)
    expected = expected_state(inputs)
    wrong = [name for name in kept if not np.array_equal(kept[name], expected[name])]
    applied = 7 * max(inputs, default=0)
    ok = not wrong and jc.elastic_progress() == applied
    assert_all(ok, f"rank {comm.rank} ({inputs[comm.rank]} of {inputs} iterations): kept "
                   f"arrays {wrong} differ from NumPy's; {jc.elastic_progress()} results "
                   f"applied, {applied} expected")


def summed_until(inputs, iterations, n=3):
    """NumPy's running sum of the active ranks' values after `iterations` iterations."""
    total = np.zeros(n)
    for t in range(iterations):
        total += sum(values(r, t, n) for r, count in enumerate(inputs) if count > t)
    return total


@pytest.mark.mpi(min_size=2)
def test_joined_ranks_hold_the_last_ranks_kept_state_in_on_save(comm):
    """Outside an elastic Join the last active rank sends its kept results when joined ranks
    read them: a save it requests while alone finds every rank's kept array equal to NumPy's
    sum up to the save's iteration, and the Join's end again."""
    inputs = [2] * (comm.size - 1) + [9]  # the last rank alone from iteration 2 on
    jc = JoinableComm(comm)
    total = jc.keep(np.zeros(3))
    saved = []

    def on_save():
        saved.append((join.iterations, total.copy()))

    try:
        with Join([jc], on_save=on_save) as join:
            for t in range(inputs[comm.rank]):
                jc.begin_iteration()
                jc.allreduce(values(comm.rank, t, 3), into=total)
                if t == 4:
                    request_save("test")
    finally:
        clear_save()
    ok = (len(saved) == 1 and np.array_equal(saved[0][1], summed_until(inputs, saved[0][0]))
          and np.array_equal(total, summed_until(inputs, 9)) and jc.elastic_progress() == 9)
    assert_all(ok, f"rank {comm.rank}: on_save saw {saved}, the Join ended with {total} "
                   f"({jc.elastic_progress()} results applied)")


@pytest.mark.mpi(min_size=2)
def test_a_call_the_last_rank_refuses_finds_every_rank_current(comm):
    """A bad argument on the last active rank raises the same kind on every rank, and the
    joined ranks' kept array holds the results it applied before."""
    inputs = [1] * (comm.size - 1) + [6]
    jc = JoinableComm(comm)
    total = jc.keep(np.zeros(3))
    with raises_everywhere(TypeError):
        with Join([jc]):
            for t in range(inputs[comm.rank]):
                jc.begin_iteration()
                jc.allreduce(values(comm.rank, t, 3), into=total)
                if t == 4:
                    jc.bcast(np.zeros(2), root="nobody")
    expected = summed_until(inputs, 5)
    assert_all(np.array_equal(total, expected), f"rank {comm.rank}: {total} != {expected}")


@pytest.mark.mpi
def test_kept_arrays_outside_a_join_are_plain_collectives(comm):
    jc = JoinableComm(comm)
    total = jc.keep(np.zeros(3))
    for t in range(3):
        jc.allreduce(values(comm.rank, t, 3), into=total)
    expected = sum(values(r, t, 3) for r in range(comm.size) for t in range(3))
    assert_all(np.array_equal(total, expected), f"rank {comm.rank}: {total} != {expected}")


@pytest.mark.mpi
def test_a_torch_tensor_is_kept_in_place(comm):
    torch = pytest.importorskip("torch")
    jc = JoinableComm(comm)
    total = jc.keep(torch.zeros(3, dtype=torch.float64))
    with Join([jc]):
        for t in range(1 + comm.rank):
            jc.begin_iteration()
            jc.allreduce(torch.from_numpy(values(comm.rank, t, 3)), into=total)
    inputs = [1 + r for r in range(comm.size)]
    expected = sum(values(r, t, 3) for r in range(comm.size) for t in range(inputs[r]))
    assert_all(np.array_equal(total.numpy(), expected), f"rank {comm.rank}: {total}")


@pytest.mark.mpi
def test_kept_arrays_that_differ_between_ranks_are_refused_everywhere(comm):
    jc = JoinableComm(comm)
    if comm.size > 1:
        with raises_everywhere(ValueError, match="different kept arrays"):
            jc.keep(np.zeros(3 if comm.rank == 0 else 4))
    with raises_everywhere(ValueError, match="shares memory"):
        shared = np.zeros(4)
        jc.keep(shared, shared[:2])
    with raises_everywhere(TypeError, match="keep.. needs at least one array"):
        jc.keep()
    total = jc.keep(np.zeros(3))
    with Join([jc]):
        jc.begin_iteration()
        with raises_everywhere(RuntimeError, match="before the Join"):
            jc.keep(np.zeros(2))
    assert_all(jc.kept == (total,), f"rank {comm.rank}: kept {jc.kept}")


@pytest.mark.mpi(min_size=2)
def test_a_kept_array_on_some_ranks_only_raises_everywhere_and_applies_nothing(comm):
    """One rank passes into=, the others not: the announcements differ, every rank raises
    before any data moves, and no kept array changes (a rank that has joined included)."""
    jc = JoinableComm(comm)
    total = jc.keep(np.zeros(3))
    with raises_everywhere(CollectiveMismatchError, match="every active rank announced"):
        with Join([jc]):
            for _ in range(1 if comm.rank == 0 else 2):  # rank 0 joins for the second
                jc.begin_iteration()
                x = np.ones(3)
                jc.allreduce(x, into=total if comm.rank != 1 else None)
    assert_all(not total.any(), f"rank {comm.rank}: kept {total} after a refused call")


@pytest.mark.mpi
def test_wrong_uses_of_a_kept_array_raise_on_every_rank(comm):
    jc = JoinableComm(comm)
    total = jc.keep(np.zeros(3))
    with raises_everywhere(ValueError, match="into= takes an array kept"):
        jc.allreduce(np.ones(3), into=np.zeros(3))
    with raises_everywhere(ValueError, match="shaped and typed like the input"):
        jc.allreduce(np.ones(3, np.float32), into=total)
    with raises_everywhere(ValueError, match="blocking allreduce and bcast"):
        jc.iallreduce(np.ones(3), out=total)
    with raises_everywhere(ValueError, match="blocking allreduce and bcast"):
        jc.ibcast(np.ones(3), out=total)
    with raises_everywhere(ValueError, match="out= or as into="):
        jc.allreduce(np.ones(3), out=total, into=total)
    assert_all(not total.any(), f"rank {comm.rank}: kept {total} after refused calls")


@pytest.mark.mpi
def test_a_joinable_comm_that_keeps_arrays_owns_the_step_in_an_elastic_join(comm):
    """Its kept arrays and their count are settled from the lowest rank that applied one more
    result (what a lost rank's interrupted allreduce leaves); beside another owner of a step
    it is refused."""
    jc = JoinableComm(comm)
    total = jc.keep(np.zeros(2))
    with Join([jc], elastic=True):
        for t in range(1 + comm.rank):
            jc.begin_iteration()
            jc.allreduce(values(comm.rank, t, 2), into=total)
    before = total.copy()
    if comm.rank % 2 == 1:  # ranks 1, 3: an interrupted allreduce completed here only
        total += 100 * comm.rank
        jc.elastic_state()[-1][0] += 1  # the count of results applied, the last array
    step, root = elastic.settle(comm, [jc], 60.0)
    ahead = comm.size > 1
    expected = before + 100 if ahead else before
    ok = np.array_equal(total, expected) and step == comm.size + ahead and \
        jc.elastic_progress() == step and root == (1 if ahead else 0)
    dp = DataParallel([np.zeros(2)], comm=comm)
    with raises_everywhere(ValueError, match="both count the updates"):
        Join([dp, SGD(dp.params, dp.grads, lr=1.0), jc], elastic=True)
    assert_all(ok, f"rank {comm.rank}: settled {total} at {step} from {root}, expected "
                   f"{expected}")


@pytest.mark.mpi(min_size=2)
def test_an_into_or_a_view_that_is_not_kept_raises_everywhere_joined_ranks_too(comm):
    """into= without keep() (it would be ignored), and out= a view of a kept array (it would
    be written on the active ranks only): ValueError on every rank, rank 0 joined."""
    jc = JoinableComm(comm)
    with raises_everywhere(ValueError, match="into= takes an array kept"):
        jc.allreduce(np.ones(2), into=np.zeros(2))  # nothing kept yet
    total = jc.keep(np.zeros(3))
    for call in (lambda: jc.allreduce(np.ones(3), out=total[...]),
                 lambda: jc.bcast(np.ones(3), out=total.reshape(3)),
                 lambda: jc.allreduce(np.ones(2), into=np.zeros(2))):
        with raises_everywhere(ValueError, match="kept|had a bad argument"):  # the joined
            with Join([jc]):
                for _ in range(0 if comm.rank == 0 else 1):
                    jc.begin_iteration()
                    call()
    assert_all(not total.any(), f"rank {comm.rank}: kept {total} after refused calls")


@pytest.mark.mpi(min_size=2)
def test_an_elastic_join_takes_one_kept_call_per_iteration(comm):
    """A second call with a kept array in one iteration of an elastic Join would be applied
    twice when a loss makes the loop redo the iteration: ValueError on every rank, the joined
    one too; outside an elastic Join two are fine."""
    jc = JoinableComm(comm)
    total, best = jc.keep(np.zeros(2), np.zeros(1))
    with raises_everywhere(ValueError, match="one call with a kept array per iteration|"
                                             "had a bad argument"):  # the joined rank's
        with Join([jc], elastic=True):
            for _ in range(0 if comm.rank == 0 else 2):
                jc.begin_iteration()
                jc.allreduce(np.ones(2), into=total)
                jc.bcast(np.ones(1), out=best)
    with Join([jc]):
        for _ in range(0 if comm.rank == 0 else 2):
            jc.begin_iteration()
            jc.allreduce(np.ones(2), into=total)
            jc.allreduce(np.ones(1), MPI.MAX, into=best)
    active = comm.size - 1
    ok = total.tolist() == [active + 2 * active] * 2 and best[0] == 1.0
    assert_all(ok, f"rank {comm.rank}: total {total}, best {best}")


@pytest.mark.mpi
def test_kept_results_never_stand_in_for_a_data_parallel_step_owner(comm):
    """Join([dp, jc], elastic=True) with kept arrays but no optimizer: the kept count is no
    step of the DataParallel's, so the Join is refused as without them."""
    jc = JoinableComm(comm)
    jc.keep(np.zeros(2))
    dp = DataParallel([np.zeros(2)], comm=comm)
    with raises_everywhere(ValueError, match="needs the joinable that applies the step"):
        Join([dp, jc], elastic=True)


@pytest.mark.mpi
@pytest.mark.parametrize("pattern", UNEVEN)
def test_kept_arrays_beside_a_data_parallel_stay_current_on_joined_ranks(comm, pattern):
    """Join([dp, jc]), not elastic: the DataParallel leads the iterations, the kept sum and
    the kept latest mean gradient (bcast from the highest active rank) are applied on joined
    ranks too; each equals NumPy's over the active ranks' values, and the averaged gradients
    are the active ranks' sum over the world size (``divide_by_initial_world_size``, torch's
    default) in every iteration."""
    inputs = inputs_of(pattern, comm.size)
    dp = DataParallel([np.zeros(3)], comm=comm)
    jc = JoinableComm(comm)
    total, latest = jc.keep(np.zeros(4), np.zeros(3))
    wrong_grads = []
    with Join([dp, jc]):
        for t in range(inputs[comm.rank]):
            with dp.step():
                dp.grads[0][...] = values(comm.rank, t, 3)
            jc.allreduce(values(comm.rank, t, 4), into=total)
            jc.bcast(dp.grads[0], out=latest)
            active = [r for r, n in enumerate(inputs) if n > t]
            mean = sum(values(r, t, 3) for r in active) / comm.size
            if not np.allclose(dp.grads[0], mean, rtol=1e-15, atol=0):
                wrong_grads.append(t)
    expected_total = np.zeros(4)
    expected_latest = np.zeros(3)
    for t in range(max(inputs, default=0)):
        active = [r for r, n in enumerate(inputs) if n > t]
        expected_total += sum(values(r, t, 4) for r in active)
        expected_latest = sum(values(r, t, 3) for r in active) / comm.size
    ok = (np.array_equal(total, expected_total) and not wrong_grads
          and np.allclose(latest, expected_latest, rtol=1e-15, atol=0))
    assert_all(ok, f"rank {comm.rank} ({inputs[comm.rank]} of {inputs}): total {total} "
                   f"(NumPy {expected_total}), latest {latest} (NumPy {expected_latest}), "
                   f"gradients wrong in iterations {wrong_grads}")


@pytest.mark.mpi(min_size=2)
def test_an_update_on_joined_ranks_reads_the_kept_arrays_current(comm):
    """Join([dp, jc]) with the last rank alone for four steps: DataParallel's ``update=`` runs
    on joined ranks too, and reads the kept total there as the last rank has it (each result
    is announced in such a Join, not sent at the end)."""
    inputs = [1] * (comm.size - 1) + [5]
    jc = JoinableComm(comm)
    total = jc.keep(np.zeros(2))
    read = []
    dp = DataParallel([np.zeros(2)], comm=comm, update=lambda: read.append(total.copy()))
    with Join([dp, jc]):
        for t in range(inputs[comm.rank]):
            with dp.step():
                dp.grads[0][...] = 1.0
            jc.allreduce(values(comm.rank, t, 2), into=total)
    expected = [summed_until(inputs, t, 2) for t in range(5)]  # read at step t: t results
    ok = len(read) == 5 and all(np.array_equal(a, b) for a, b in zip(read, expected))
    assert_all(ok, f"rank {comm.rank}: update= read {read}, NumPy {expected}")
