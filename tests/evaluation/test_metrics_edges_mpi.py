"""torchmetrics over MPI, the edges a new torch user met: a list-state metric (AUROC) with a
rank that has no samples equals one process; a metric built with sync_options pickles, and a
loaded one syncs again."""

import pickle

import numpy as np
import pytest

from tensorplay_mpi.metrics import SyncGroup, gather_all_tensors, sync_options
from tensorplay_mpi.testing import assert_all

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
