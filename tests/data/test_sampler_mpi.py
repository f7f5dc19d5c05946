"""data.Sampler under mpiexec as a torch DataLoader's ``batch_sampler`` with worker processes
(which take batches from the sampler ahead of the loop): a run stopped after some batches, saved
and resumed, at the same world size or another, uses every sample of the epoch exactly once
(the sample ids the loop saw, gathered, against the data set's own ids)."""

import collections

import numpy as np
import pytest
from mpi4py import MPI

from tensorplay_mpi import DataParallel, Join, checkpoint, clear_stop, request_stop
from tensorplay_mpi.data import Sampler
from tensorplay_mpi.testing import assert_all

torch = pytest.importorskip("torch")

SAMPLES, BATCH, SKEW = 53, 3, 1.0


class Ids(torch.utils.data.Dataset):
    """Sample ``i`` is its own id: what a batch holds is what the loop consumed."""

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return torch.tensor(i)


def loader(sampler):
    """The DataLoader recipe of docs/stopping.md: two workers, pinned memory where there is an
    accelerator to pin it for."""
    return torch.utils.data.DataLoader(Ids(), batch_sampler=sampler, num_workers=2,
                                       pin_memory=torch.cuda.is_available())


def epoch(comm, sampler, used, stop_at=None):
    """The epoch from the sampler's cursor on; the last rank asks to stop at its iteration
    `stop_at` (every rank then leaves at one iteration, the batch in hand unconsumed)."""
    params = [np.zeros(1)]
    dp = DataParallel(params, comm=comm)
    with Join([dp]) as join:
        for i, batch in enumerate(sampler.track(loader(sampler))):
            if join.stopped:
                break
            if i == stop_at and comm.rank == comm.size - 1:
                request_stop("test")
            with dp.step():
                dp.grads[0][...] = float(batch.sum())
            used.extend((sampler.epoch, int(s)) for s in batch)
    clear_stop()
    return join.stopped


def sub_comm(comm, size):
    return comm.Split(0 if comm.rank < size else MPI.UNDEFINED, comm.rank)


@pytest.mark.mpi
@pytest.mark.parametrize("stop_at", [1, 3])
@pytest.mark.parametrize("fewer", [0, 1], ids=["same-size", "one-rank-fewer"])
def test_a_dataloader_with_workers_stopped_saved_and_resumed_uses_each_sample_once(
        comm, tmp_path, stop_at, fewer):
    """Before: the cursor counted the batches the workers had taken (6 after 3 consumed), so
    the resumed run skipped the batches prefetched but never consumed."""
    if fewer >= comm.size:
        pytest.skip("needs 2 ranks")
    directory = comm.bcast(str(tmp_path))
    used = []
    sampler = Sampler(SAMPLES, comm.rank, comm.size, batch_size=BATCH, seed=5, skew=SKEW)
    stopped = epoch(comm, sampler, used, stop_at=stop_at)
    checkpoint.save(directory, [np.zeros(1)], epoch=1, cursor=sampler.cursor,
                    extra={"sampler": sampler.state()}, comm=comm)
    assert_all(stopped, "the run did not stop")

    sub = sub_comm(comm, comm.size - fewer)
    if sub != MPI.COMM_NULL:
        resumed = checkpoint.load(directory, [np.zeros(1)], comm=sub, resize=bool(fewer))
        sampler = Sampler(SAMPLES, sub.rank, sub.size, batch_size=BATCH, seed=5, skew=SKEW)
        sampler.resume(resumed.epoch, resumed.cursors, resumed.extra["sampler"])
        epoch(sub, sampler, used)
        sampler.set_epoch(2)  # a whole epoch through the loader: each sample once too
        epoch(sub, sampler, used)
        sub.Free()
    every = collections.Counter(u for ids in comm.allgather(used) for u in ids)
    for e in (1, 2):
        counts = [every[(e, s)] for s in range(SAMPLES)]
        assert_all(counts == [1] * SAMPLES,
                   f"epoch {e}: sample ids used {dict(collections.Counter(counts))} times "
                   f"(0: skipped), missing {[s for s in range(SAMPLES) if not every[(e, s)]]}")
