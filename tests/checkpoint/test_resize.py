"""A checkpoint written at N ranks resumes at M ranks (sub-communicators of the world): the
replicated state as saved, the ZeRO state re-sharded (equal to a replicated optimizer's), and
every sample of the interrupted epoch, and of the next, used exactly once (ids logged)."""

import collections

import numpy as np
import pytest
from mpi4py import MPI

from tensorplay_mpi import (Adam, DataParallel, Join, ZeroRedundancyOptimizer, checkpoint,
                            clear_stop, request_stop)
from tensorplay_mpi.data import Sampler
from tensorplay_mpi.checkpoint import PerRank
from tensorplay_mpi.testing import assert_all, raises_everywhere

SAMPLES, BATCH, SKEW = 61, 4, 1.0
PAIRS = [(2, 3), (3, 2), (4, 2), (1, 2), (2, 1)]


def data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(SAMPLES, 3))
    return x, x @ np.array([1.0, -2.0, 0.5]) + 0.1 * rng.normal(size=SAMPLES)


def model(sub, zero):
    params = [np.zeros(3)]
    dp = DataParallel(params, comm=sub)
    opt = (ZeroRedundancyOptimizer(params, dp.grads, Adam, comm=sub, lr=0.05) if zero
           else Adam(params, dp.grads, lr=0.05))
    return params, dp, opt


def epoch(sub, sampler, dp, opt, used, stop_at=None):
    """One epoch (from the sampler's cursor); the last rank asks to stop before its iteration
    `stop_at`."""
    x, y = data()
    with Join([dp, opt]) as join:
        for i, idx in enumerate(sampler):
            if join.stopped:
                break
            if i == stop_at and sub.rank == sub.size - 1:
                request_stop("test")
            with dp.step():
                residual = x[idx] @ dp.params[0] - y[idx]
                dp.grads[0][...] = x[idx].T @ residual / len(idx)
            opt.step()
            used.extend((sampler.epoch, int(s)) for s in idx)
    clear_stop()
    return join.stopped


def sub_comm(comm, size):
    return comm.Split(0 if comm.rank < size else MPI.UNDEFINED, comm.rank)


@pytest.mark.mpi
@pytest.mark.parametrize("pair", PAIRS, ids=[f"{n}to{m}" for n, m in PAIRS])
def test_a_checkpoint_resumes_at_another_world_size_with_every_sample_once(comm, tmp_path, pair):
    n, m = pair
    if max(pair) > comm.size:
        pytest.skip(f"needs {max(pair)} ranks")
    directory = comm.bcast(str(tmp_path))
    used, reference, stopped = [], None, True
    sub = sub_comm(comm, n)
    if sub != MPI.COMM_NULL:
        ref_params, ref_dp, ref_opt = model(sub, zero=False)  # the replicated optimizer
        epoch(sub, Sampler(SAMPLES, sub.rank, n, batch_size=BATCH, skew=SKEW), ref_dp, ref_opt,
              [], stop_at=2)
        reference = ref_opt.state_dict()
        params, dp, opt = model(sub, zero=True)
        sampler = Sampler(SAMPLES, sub.rank, n, batch_size=BATCH, skew=SKEW)
        stopped = epoch(sub, sampler, dp, opt, used, stop_at=2)
        checkpoint.save(directory, params, optimizer=opt, epoch=1, cursor=sampler.cursor,
                        extra={"sampler": sampler.state()}, comm=sub)
        saved = params[0].copy()
        sub.Free()
    assert_all(stopped, "the run at N ranks did not stop")
    saved, reference = comm.bcast((saved, reference) if comm.rank == 0 else None)

    sub = sub_comm(comm, m)
    same = True
    if sub != MPI.COMM_NULL:
        params, dp, opt = model(sub, zero=True)
        resumed = checkpoint.load(directory, params, optimizer=opt, comm=sub, resize=True)
        same = params[0].tobytes() == saved.tobytes() and resumed.world_size == n
        opt.consolidate_state_dict(to=0)
        if sub.rank == 0:
            state = opt.state_dict()["state"]
            same = same and all(state[0][k].tobytes() == reference["state"][0][k].tobytes()
                                for k in reference["state"][0])
        sampler = Sampler(SAMPLES, sub.rank, m, batch_size=BATCH, skew=SKEW)
        sampler.resume(resumed.epoch, resumed.cursors, resumed.extra["sampler"])
        epoch(sub, sampler, dp, opt, used)
        sampler.set_epoch(2)
        epoch(sub, sampler, dp, opt, used)
        sub.Free()
    assert_all(same, "the state loaded at another world size is not the saved one")
    every = collections.Counter(u for ids in comm.allgather(used) for u in ids)
    for e in (1, 2):
        counts = [every[(e, s)] for s in range(SAMPLES)]
        assert_all(counts == [1] * SAMPLES,
                   f"epoch {e}: samples used {collections.Counter(counts)} times")


@pytest.mark.mpi(min_size=2)
def test_a_resume_at_another_size_needs_resize_and_sampler_state(comm, tmp_path):
    directory = comm.bcast(str(tmp_path))
    sub = sub_comm(comm, 1)
    if sub != MPI.COMM_NULL:
        checkpoint.save(directory, [np.zeros(3)], epoch=1, cursor=3, comm=sub)
        sub.Free()
    with raises_everywhere(ValueError, match=r"saved at 1 ranks, this job has \d+.*resize=True"):
        checkpoint.load(directory, [np.zeros(3)], comm=comm)
    resumed = checkpoint.load(directory, [np.zeros(3)], comm=comm, resize=True)
    sampler = Sampler(SAMPLES, comm.rank, comm.size, batch_size=BATCH)
    with raises_everywhere(ValueError, match="holds no sampler state"):
        sampler.resume(resumed.epoch, resumed.cursors, resumed.extra.get("sampler"))


@pytest.mark.mpi(min_size=2)
def test_per_rank_values_at_another_world_size_are_absent_and_reading_one_says_why(comm,
                                                                                  tmp_path):
    """Each rank's own value belongs to a rank of the saving run: at another world size none
    comes back (no rank gets another's); at the saving size each rank gets its own."""
    directory = comm.bcast(str(tmp_path))
    extra = {"tally": PerRank(np.array([comm.rank, 7])), "shared": np.arange(2)}
    checkpoint.save(directory, [np.zeros(3)], epoch=1, extra=extra, comm=comm)
    sub = sub_comm(comm, comm.size - 1)
    ok, detail = True, ""
    if sub != MPI.COMM_NULL:
        resumed = checkpoint.load(directory, [np.zeros(3)], comm=sub, resize=True)
        try:
            resumed.extra["tally"]
            ok, detail = False, "a per-rank value came back at another world size"
        except KeyError as missing:
            detail = str(missing)
            ok = (f"saved per rank (checkpoint.PerRank) at {comm.size} ranks" in detail
                  and f"this job has {comm.size - 1}" in detail)
        ok = ok and "tally" not in resumed.extra and resumed.extra.get("tally") is None
        ok = ok and resumed.extra["shared"].tolist() == [0, 1]
        sub.Free()
    assert_all(ok, detail)
    resumed = checkpoint.load(directory, [np.zeros(3)], comm=comm, resize=True)
    assert_all(resumed.extra["tally"].tolist() == [comm.rank, 7], str(resumed.extra))
