"""ZeRO's sharded state saved at N ranks and loaded with resize=True at M: every piece of
per-parameter state kept (moments, momentum buffers and per-parameter step counts), against a
serial torch.optim replay of the same averaged gradients, a parameter unused in some steps."""

import numpy as np
import pytest
from mpi4py import MPI

from tensorplay_mpi import (SGD, Adam, AdamW, DataParallel, ZeroRedundancyOptimizer,
                            checkpoint)
from tensorplay_mpi.testing import assert_all

torch = pytest.importorskip("torch")

SHAPES = [(5,), (3, 2), (4,), (7,)]
UNUSED = 1  # no rank produces its gradient in the steps of UNUSED_STEPS
UNUSED_STEPS = (0, 2, 4)
OPTIMIZERS = {
    "sgd": (SGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (Adam, torch.optim.Adam, {"lr": 0.05}),
    "adamw": (AdamW, torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
}
PAIRS = [(1, 2), (2, 1), (2, 3), (3, 2)]


def grad(rank, t, k):
    g = np.random.default_rng([rank, t, k]).standard_normal(SHAPES[k])
    return np.zeros(SHAPES[k]) if k == UNUSED and t in UNUSED_STEPS else g


def train(sub, params, dp, opt, steps):
    for t in steps:
        unused = [UNUSED] if t in UNUSED_STEPS else []
        with dp.step(unused=unused):
            for k, g in enumerate(dp.grads):
                g[...] = grad(sub.rank, t, k)
        opt.step()


def serial(torch_class, hyper, sizes):
    """`sizes[t]`: the world size of step t; the gradient is the mean over those ranks."""
    params = [torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in SHAPES]
    opt = torch_class(params, **hyper)
    for t, size in enumerate(sizes):
        for k, p in enumerate(params):
            p.grad = (None if k == UNUSED and t in UNUSED_STEPS else
                      torch.from_numpy(sum(grad(r, t, k) for r in range(size)) / size))
        opt.step()
    return [p.detach().numpy() for p in params]


def sub_comm(comm, size):
    return comm.Split(0 if comm.rank < size else MPI.UNDEFINED, comm.rank)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_sharded_state_resharded_at_another_size_steps_as_serial(comm, tmp_path, name):
    ours, theirs, hyper = OPTIMIZERS[name]
    directory = comm.bcast(str(tmp_path))
    ok = True
    for before, after in [p for p in PAIRS if max(p) <= comm.size]:
        path = f"{directory}/{before}-{after}"
        sub = sub_comm(comm, before)
        if sub != MPI.COMM_NULL:
            params = [np.zeros(s) for s in SHAPES]
            dp = DataParallel(params, comm=sub)
            opt = ZeroRedundancyOptimizer(params, dp.grads, ours, comm=sub, **hyper)
            train(sub, params, dp, opt, range(3))
            checkpoint.save(path, params, optimizer=opt, zero="sharded", comm=sub)
            sub.Free()
        comm.Barrier()
        sub = sub_comm(comm, after)
        if sub != MPI.COMM_NULL:
            params = [np.zeros(s) for s in SHAPES]
            dp = DataParallel(params, comm=sub)
            opt = ZeroRedundancyOptimizer(params, dp.grads, ours, comm=sub, **hyper)
            checkpoint.load(path, params, optimizer=opt, comm=sub, resize=True)
            train(sub, params, dp, opt, range(3, 6))
            expected = serial(theirs, hyper, [before] * 3 + [after] * 3)
            ok &= all(np.allclose(p, e, rtol=1e-12, atol=1e-12)
                      for p, e in zip(params, expected))
            sub.Free()
        comm.Barrier()
    assert_all(ok, f"{name}: a resharded state did not step as serial torch.optim")
