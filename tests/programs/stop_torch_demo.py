"""The torch demo, sent a real signal at a chosen batch: a deterministic stop for the tests.

    mpiexec -n N python -m mpi4py tests/programs/stop_torch_demo.py SIGNAL RANKS BATCH ARGS...

As stop_demo.py, for ``python -m tensorplay_mpi.examples.train_torch ARGS``: rank(s) RANKS
(``all``, or a comma-separated list) send themselves SIGNAL from inside the forward pass of
their batch number BATCH (counted from 1 over the run).
"""

import os
import signal
import sys

from mpi4py import MPI

from tensorplay_mpi.examples import train_torch

name, ranks, batch, *demo = sys.argv[1:]
signals_me = ranks == "all" or str(MPI.COMM_WORLD.rank) in ranks.split(",")
loss_of, calls = train_torch.loss_of, [0]


def signalling_loss_of(*args):
    calls[0] += 1
    if signals_me and calls[0] == int(batch):
        os.kill(os.getpid(), signal.Signals[name])
    return loss_of(*args)


train_torch.loss_of = signalling_loss_of
status = train_torch.main(demo)
if status == train_torch.STOPPED:
    MPI.Finalize()
sys.exit(status)
