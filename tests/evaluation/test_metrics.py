"""Metrics over uneven shards under mpiexec: every sample counted once, as one process would.

The validation set has 53 samples (prime: never divisible by ranks times the batch size), split
by :func:`tensorplay_mpi.data.shard` without padding, skewed or with an idle rank.  References
are computed serially with NumPy from the whole set (or, per step, from the batches of the
ranks active in that step), never with the library.
"""

import numpy as np
import pytest
from mpi4py import MPI

from tensorplay_mpi import Join, JoinableComm
from tensorplay_mpi.data import batches, shard
from tensorplay_mpi.evaluation.metrics import (confusion_matrix, distributed_available,
                                               gather_all_tensors, reduce_states, sync_options)
from tensorplay_mpi.testing import assert_all, raises_everywhere

N, CLASSES, BATCH = 53, 5, 4
SPLITS = {"skewed": {"skew": 1.5}, "idle_first": {"idle": (0,)}, "even": {}}


def validation_set():
    g = np.random.default_rng(7)
    logits = g.standard_normal((N, CLASSES)).astype(np.float32)
    labels = g.integers(0, CLASSES, N)
    labels[:20] = logits[:20].argmax(1)  # some right, most wrong
    preds, target = g.standard_normal(N).astype(np.float32), g.standard_normal(N).astype(
        np.float32)
    return logits, labels, preds, target


def batches_of(size, split):
    """Every rank's batches (index arrays), in order: what each rank iterates over."""
    options = dict(SPLITS[split])
    if size == 1:
        options.pop("idle", None)
    return [batches(shard(N, r, size, **options), BATCH) for r in range(size)]


def step_indices(every, t):
    """The samples of the ranks active in step `t`, in rank order."""
    return np.concatenate([b[t] for b in every if len(b) > t])


def test_serial_confusion_matrix_and_errors():
    cm = confusion_matrix([0, 1, 2, 2], [0, 2, 2, 1], 3)
    assert cm.tolist() == [[1, 0, 0], [0, 0, 1], [0, 1, 1]] and cm.dtype == np.int64
    with pytest.raises(ValueError, match="outside"):
        confusion_matrix([0, 3], [0, 1], 3)
    with pytest.raises(ValueError, match="differ in length"):
        confusion_matrix([0, 1], [0], 3)


@pytest.mark.mpi
@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.filterwarnings("ignore:The ``compute`` method")  # an idle rank updated nothing
def test_torchmetrics_accuracy_and_mse_synced_each_step_equal_one_process(comm, split):
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchmetrics")
    from torchmetrics import MeanSquaredError
    from torchmetrics.classification import MulticlassAccuracy

    logits, labels, preds, target = validation_set()
    every = batches_of(comm.size, split)
    assert N % (comm.size * BATCH) != 0
    jc = JoinableComm(comm)
    acc = MulticlassAccuracy(num_classes=CLASSES, average="micro", dist_sync_on_step=True,
                             **sync_options(jc))
    mse = MeanSquaredError(dist_sync_on_step=True, **sync_options(jc))
    wrong = []
    with Join([jc]):
        for t, idx in enumerate(every[comm.rank]):
            jc.begin_iteration()
            a = acc(torch.from_numpy(logits[idx]), torch.from_numpy(labels[idx]))
            m = mse(torch.from_numpy(preds[idx]), torch.from_numpy(target[idx]))
            step = step_indices(every, t)  # the step's value over the active ranks' batches
            a_ref = (logits[step].argmax(1) == labels[step]).mean()
            m_ref = ((preds[step].astype(np.float64) - target[step]) ** 2).mean()
            if not (np.isclose(float(a), a_ref, rtol=1e-6)
                    and np.isclose(float(m), m_ref, rtol=1e-5)):
                wrong.append((t, float(a), a_ref, float(m), m_ref))
    assert_all(not wrong, f"step values differ: {wrong[:3]}")

    accuracy, error = float(acc.compute()), float(mse.compute())  # synced over every rank
    correct = int((logits.argmax(1) == labels).sum())
    m_ref = ((preds.astype(np.float64) - target) ** 2).mean()
    for metric in (acc, mse):  # sync() by hand does not use the metric's dist_sync_fn
        metric.sync(dist_sync_fn=gather_all_tensors, should_sync=comm.size > 1)
    states = (int(acc.tp.sum()), int((acc.tp + acc.fn).sum()), int(mse.total))
    assert_all(states == (correct, N, N), f"integer states {states}, expected {correct, N, N}")
    assert_all(accuracy == pytest.approx(correct / N, rel=1e-6)
               and error == pytest.approx(m_ref, rel=1e-5),
               f"accuracy {accuracy} vs {correct / N}, mse {error} vs {m_ref}")


@pytest.mark.mpi
def test_gather_all_tensors_different_shapes_over_a_communicator(comm):
    torch = pytest.importorskip("torch")

    def mine(rank):
        return (torch.arange(3 * rank, dtype=torch.float32).reshape(rank, 3),
                torch.tensor(rank * 10, dtype=torch.int64),
                torch.tensor([True] * (rank % 2), dtype=torch.bool))

    ok = []
    for i, tensor in enumerate(mine(comm.rank)):
        gathered = gather_all_tensors(tensor, comm)
        expected = [mine(r)[i] for r in range(comm.size)]
        ok.append(len(gathered) == comm.size and gathered[comm.rank] is tensor and all(
            g.dtype == e.dtype and g.shape == e.shape and torch.equal(g, e)
            for g, e in zip(gathered, expected)))
    arrays = gather_all_tensors(np.full((comm.rank + 1, 2), comm.rank, np.int16), comm)
    ok.append([a.tolist() for a in arrays] == [[[r, r]] * (r + 1) for r in range(comm.size)])
    assert_all(all(ok), f"gathered wrongly: {ok}")
    assert_all(distributed_available() == (MPI.COMM_WORLD.Get_size() > 1))


@pytest.mark.mpi
def test_gather_all_tensors_inside_a_join_holds_the_active_ranks(comm):
    torch = pytest.importorskip("torch")
    inputs = [2 + (r % 3) for r in range(comm.size)]
    jc = JoinableComm(comm)
    wrong = []
    with Join([jc]):
        for t in range(inputs[comm.rank]):
            jc.begin_iteration()
            got = gather_all_tensors(torch.full((comm.rank % 2 + 1,), float(t + comm.rank)), jc)
            active = [r for r in range(comm.size) if inputs[r] > t]
            expected = [[float(t + r)] * (r % 2 + 1) for r in active]
            if [g.tolist() for g in got] != expected:
                wrong.append((t, [g.tolist() for g in got], expected))
    assert_all(not wrong, f"{wrong[:2]}")


@pytest.mark.mpi
@pytest.mark.parametrize("split", sorted(SPLITS))
def test_numpy_confusion_matrix_and_running_loss_inside_and_after_a_join(comm, split):
    logits, labels, preds, target = validation_set()
    every = batches_of(comm.size, split)
    jc = JoinableComm(comm)
    cm = np.zeros((CLASSES, CLASSES), np.int64)
    loss_sum, count, wrong = 0.0, 0, []
    with Join([jc]):
        for t, idx in enumerate(every[comm.rank]):
            jc.begin_iteration()
            batch_cm = confusion_matrix(labels[idx], logits[idx].argmax(1), CLASSES)
            batch_loss = float(((preds[idx] - target[idx]) ** 2).sum())
            step = reduce_states({"cm": batch_cm, "loss": batch_loss, "n": len(idx)}, jc)
            ref = step_indices(every, t)
            ref_cm = np.zeros((CLASSES, CLASSES), np.int64)
            np.add.at(ref_cm, (labels[ref], logits[ref].argmax(1)), 1)
            if not (np.array_equal(step["cm"], ref_cm) and step["n"] == ref.size):
                wrong.append(t)
            cm += batch_cm
            loss_sum += batch_loss
            count += len(idx)
    totals = reduce_states({"cm": cm, "loss": loss_sum, "count": count}, comm)  # after: plain
    ref_cm = np.zeros((CLASSES, CLASSES), np.int64)
    for true, guess in zip(labels, logits.argmax(1)):
        ref_cm[true, guess] += 1
    ref_loss = ((preds.astype(np.float64) - target) ** 2).mean()
    assert_all(not wrong, f"per-step states wrong at steps {wrong}")
    assert_all(np.array_equal(totals["cm"], ref_cm) and totals["count"] == N
               and totals["cm"].dtype == np.int64, f"{totals}")
    assert_all(np.isclose(totals["loss"] / totals["count"], ref_loss, rtol=1e-6),
               f"mean loss {totals['loss'] / totals['count']} vs {ref_loss}")


@pytest.mark.mpi
def test_reduce_states_refuses_complex_states_on_every_rank(comm):
    with raises_everywhere(TypeError, match="complex128"):
        reduce_states({"z": np.ones(2, complex)}, comm)


# Layouts that differ on the last rank only.  Unchecked, each was a silent wrong sum: [2, 2, 2,
# 1] on the rank with 4 values, a name summed with another, float bits summed as int64.
_MISMATCHED = {
    "shape": ({"a": np.ones(3)}, {"a": np.ones(4)}),
    "same_count_other_split": ({"a": np.ones(2), "b": np.ones(1)},
                               {"a": np.ones(1), "b": np.ones(2)}),
    "name": ({"a": np.ones(3)}, {"b": np.ones(3)}),
    "kind": ({"a": np.ones(3)}, {"a": np.ones(3, np.int64)}),
    "reshaped": ({"a": np.ones((2, 3))}, {"a": np.ones((3, 2))}),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", sorted(_MISMATCHED))
def test_reduce_states_refuses_states_that_differ_between_ranks_on_every_rank(comm, case):
    same, other = _MISMATCHED[case]
    states = other if comm.rank == comm.size - 1 else same
    with raises_everywhere(ValueError, match="ranks passed different states"):
        reduce_states(states, comm)
    totals = reduce_states(same, comm)  # nothing left pending: the next reduction is exact
    assert_all(all(np.array_equal(totals[k], comm.size * v) for k, v in same.items()),
               f"{totals}")


@pytest.mark.mpi(min_size=2)
def test_reduce_states_refuses_different_states_inside_a_join_and_the_join_goes_on(comm):
    """Every rank active: each raises the ValueError at the same point (the communicator stays
    usable).  With a rank joined, the active ranks raise it and the joined ones a
    PeerFailureError naming it (tests/programs/failures.py covers that path)."""
    jc = JoinableComm(comm)
    with raises_everywhere(ValueError, match="ranks passed different states"):
        with Join([jc]):
            jc.begin_iteration()
            reduce_states({"a": np.ones(4 if comm.rank == comm.size - 1 else 3)}, jc)
    with Join([jc]):
        for _ in range(1 + comm.rank):  # uneven: the last iterations with ranks joined
            jc.begin_iteration()
            totals = reduce_states({"a": np.ones(3)}, jc)
    # this rank's last iteration is its (rank + 1)-th: ranks rank..size-1 are active in it
    assert_all(np.array_equal(totals["a"], np.full(3, comm.size - comm.rank)), f"{totals}")


@pytest.mark.mpi
def test_gather_all_tensors_refuses_what_mpi_cannot_carry_on_every_rank(comm):
    torch = pytest.importorskip("torch")
    with raises_everywhere(TypeError, match="bfloat16"):
        gather_all_tensors(torch.ones(2, dtype=torch.bfloat16), comm)
    with raises_everywhere(TypeError, match="group"):
        gather_all_tensors(torch.ones(2), group="world")


@pytest.mark.mpi
def test_a_copied_metric_or_model_shares_the_joinable_comm(comm):
    import copy

    pytest.importorskip("torch")
    pytest.importorskip("torchmetrics")
    from torchmetrics import MeanSquaredError

    from tensorplay_mpi.evaluation._sync_batchnorm import SyncBatchNorm

    jc = JoinableComm(comm)
    metric = MeanSquaredError(**sync_options(jc)).clone()
    layer = copy.deepcopy(SyncBatchNorm(2, process_group=jc))
    assert_all(metric.process_group.group is jc and layer.process_group is jc)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("call", ["gather_all_tensors", "reduce_states"])
def test_a_plain_communicator_inside_a_join_is_refused_before_its_collective(comm, call):
    """Over the Join's own communicator the collective would match a joined rank's polls; the
    refusal comes first, on every rank, and the communicator and the JoinableComm stay usable
    (the sums after it are exact)."""
    jc = JoinableComm(comm)
    with raises_everywhere(RuntimeError, match=r"plain communicator inside a running Join.*"
                                               r"SyncGroup\(jc\)"):
        with Join([jc]):
            jc.begin_iteration()
            if call == "gather_all_tensors":
                gather_all_tensors(np.arange(3), comm)
            else:
                reduce_states({"n": 1}, comm)
    with Join([jc]):
        jc.begin_iteration()
        inside = reduce_states({"n": 1}, jc)["n"]
    after = reduce_states({"n": 1}, comm)["n"]
    assert_all(inside == after == comm.size, f"sums {inside}, {after}: expected {comm.size}")


@pytest.mark.mpi
def test_a_one_process_communicator_inside_a_join_is_not_refused(comm):
    """MPI.COMM_SELF (a rank-local tally) waits for no other rank, so no joined rank can miss
    its collective: it works inside a running Join, as outside."""
    jc = JoinableComm(comm)
    with Join([jc]):
        jc.begin_iteration()
        tally = reduce_states({"n": comm.rank + 1.0}, MPI.COMM_SELF)["n"]
        rows = gather_all_tensors(np.array([comm.rank]), MPI.COMM_SELF)
    got = (float(np.asarray(tally)), [np.asarray(r).tolist() for r in rows])
    assert_all(got == (comm.rank + 1.0, [[comm.rank]]), f"COMM_SELF inside a Join gave {got}")
