"""torchmetrics over MPI, the edges a new torch user met: a list-state metric (AUROC) with a
rank that has no samples equals one process; a metric built with sync_options pickles, and a
loaded one syncs again."""

import pickle
import re
import time

import numpy as np
import pytest
from helpers import PROGRAMS, results

from tensorplay_mpi import Join, JoinableComm
from tensorplay_mpi.evaluation.metrics import SyncGroup, gather_all_tensors, sync_options
from tensorplay_mpi.testing import assert_all, raises_everywhere, run_mpi

torch = pytest.importorskip("torch")
pytest.importorskip("torchmetrics")
from torchmetrics.classification import BinaryAUROC, MulticlassAccuracy  # noqa: E402

SAMPLES = 40


def data():
    g = torch.Generator().manual_seed(7)
    return torch.rand(SAMPLES, generator=g), torch.randint(0, 2, (SAMPLES,), generator=g)


def my_share(comm):
    """Rank 0 has no samples; the others split the rest unevenly."""
    if comm.size == 1:
        return slice(0, SAMPLES)
    bounds = np.linspace(0, SAMPLES, comm.size).astype(int)
    return slice(0, 0) if comm.rank == 0 else slice(bounds[comm.rank - 1], bounds[comm.rank])


@pytest.mark.mpi
def test_auroc_with_a_rank_without_samples_equals_one_process(comm):
    preds, target = data()
    metric = BinaryAUROC(**sync_options(comm))
    share = my_share(comm)
    if share.stop > share.start:
        metric.update(preds[share], target[share])
    got = float(metric.compute())
    expected = float(BinaryAUROC()(preds, target))
    assert_all(abs(got - expected) < 1e-6, f"AUROC {got} against one process {expected}")


@pytest.mark.mpi
def test_an_empty_tensor_comes_back_in_the_dtype_of_the_others(comm):
    mine = (torch.zeros(0) if comm.rank == 0 and comm.size > 1 else
            torch.arange(3, dtype=torch.int64))
    gathered = gather_all_tensors(mine, comm)
    assert_all(all(t.dtype == torch.int64 for t in gathered) and
               torch.cat(gathered).dtype == torch.int64, [t.dtype for t in gathered])


@pytest.mark.mpi
@pytest.mark.parametrize("group", ["comm", "default"])
def test_a_metric_with_sync_options_pickles_and_syncs_after_loading(comm, group):
    preds = torch.tensor([comm.rank % 3, 1, 2])
    target = torch.tensor([comm.rank % 3, 0, 2])
    metric = MulticlassAccuracy(num_classes=3, average="micro",
                                **sync_options(comm if group == "comm" else None))
    metric.update(preds, target)
    loaded = pickle.loads(pickle.dumps(metric))
    assert_all(isinstance(loaded.process_group, SyncGroup))
    got = float(loaded.compute())
    assert_all(abs(got - 2 / 3) < 1e-6, f"accuracy {got} after loading, expected 2/3")



@pytest.mark.mpi(min_size=2)  # one rank: torchmetrics does not sync
def test_a_loaded_metric_inside_a_join_is_refused_before_its_sync(comm):
    """A metric pickled with sync_options(jc) syncs over the default communicator once loaded:
    inside the running Join, every rank active, each refuses its sync at the same point,
    naming SyncGroup(jc), before any collective, so the JoinableComm stays usable; given its
    group back, the metric syncs in the same Join form (a rank joined: metric_misuse.py)."""
    jc = JoinableComm(comm)
    metric = pickle.loads(pickle.dumps(MulticlassAccuracy(
        num_classes=3, average="micro", dist_sync_on_step=True, **sync_options(jc))))
    with raises_everywhere(RuntimeError, match=r"plain communicator.*SyncGroup\(jc\)"):
        with Join([jc]):
            jc.begin_iteration()
            metric(torch.tensor([0, 1]), torch.tensor([0, 2]))
    metric.process_group = SyncGroup(jc)
    with Join([jc]):
        for _ in range(1 + comm.rank):
            jc.begin_iteration()
            step_accuracy = float(metric(torch.tensor([0, 1]), torch.tensor([0, 2])))
    # this rank's last iteration has ranks rank..size-1 active, each right on 1 of 2 samples
    assert_all(abs(step_accuracy - 0.5) < 1e-6, f"step accuracy {step_accuracy}, expected 1/2")


@pytest.mark.parametrize("nprocs", [2, 3])
def test_a_loaded_metric_synced_after_a_rank_joined_ends_every_rank_with_the_remedy(nprocs):
    """The active ranks refuse the sync (RuntimeError naming SyncGroup(jc)) before any
    collective; rank 0, in its join loop, gets it as a PeerFailureError within its next wait.
    No rank gets a value, and the job ends."""
    start = time.monotonic()
    result = run_mpi(nprocs, [str(PROGRAMS / "metric_misuse.py")], timeout=90)
    elapsed = time.monotonic() - start
    outcomes = results(result.stdout)
    assert result.returncode != 0 and elapsed < 30, (elapsed, result.stdout, result.stderr)
    assert "VALUE" not in result.stdout, result.stdout
    remedy = "plain communicator inside a running Join"
    assert re.match(r"PeerFailureError: rank 0: rank \d failed with RuntimeError: "
                    r"gather_all_tensors", outcomes[0]) and "SyncGroup(jc)" in outcomes[0], \
        outcomes
    for rank in range(1, nprocs):
        assert outcomes[rank].startswith("RuntimeError: gather_all_tensors") and \
            remedy in outcomes[rank] and "SyncGroup(jc)" in outcomes[rank], outcomes
