"""The checkpoints of tests/checkpoint/fixtures/checkpoints-v1, and what one more step gives
after each.

Run with the version whose files the fixtures keep (the manifest format 1, before the
optimizer protocol), at 2 ranks::

    PYTHONPATH=OLD_CHECKOUT mpiexec -n 2 python -m mpi4py tests/programs/checkpoint_fixtures.py DIR

For each kind (a local Adam; ZeRO over SGD with momentum, saved sharded and consolidated) it
steps three times, saves ``DIR/KIND``, steps once more and writes the parameters then to
``DIR/KIND-after.npz``.  ``tests/checkpoint/test_checkpoint_compat.py`` loads each with the
current version, steps once and compares bitwise.
"""

import sys

import numpy as np
from mpi4py import MPI

SHAPES = [(5, 3), (7,), (), (2, 2, 2), (11,)]
KINDS = [("local", "sharded"), ("zero", "sharded"), ("zero", "consolidated")]
STEPS = 3  # before the save


def initial_params():
    rng = np.random.default_rng(0)
    return [rng.normal(size=s) for s in SHAPES]


def step(opt, grads, t):
    """Step `opt` with the gradients of step `t` written into `grads`."""
    rng = np.random.default_rng(100 + t)
    for g, s in zip(grads, SHAPES):
        g[...] = rng.normal(size=s)
    opt.step()


def make(kind, params, grads, comm):
    from tensorplay_mpi import SGD, Adam, ZeroRedundancyOptimizer

    if kind == "local":
        return Adam(params, grads, lr=0.01, weight_decay=0.1)
    return ZeroRedundancyOptimizer(params, grads, SGD, comm=comm, lr=0.05, momentum=0.9)


def main(root):
    from tensorplay_mpi import checkpoint

    comm = MPI.COMM_WORLD
    for kind, zero in KINDS:
        params, grads = initial_params(), [np.zeros(s) for s in SHAPES]
        opt = make(kind, params, grads, comm)
        for t in range(STEPS):
            step(opt, grads, t)
        checkpoint.save(f"{root}/{kind}-{zero}", params, optimizer=opt, step=STEPS, zero=zero,
                        comm=comm)
        step(opt, grads, STEPS)
        if comm.rank == 0:
            np.savez(f"{root}/{kind}-{zero}-after.npz", *params)


if __name__ == "__main__":
    main(sys.argv[1])
