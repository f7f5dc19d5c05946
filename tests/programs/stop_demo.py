"""The demo, sent a real signal at a chosen batch: a deterministic stop for the tests.

    mpiexec -n N python -m mpi4py tests/programs/stop_demo.py SIGNAL RANKS BATCH DEMO-ARGS...

Rank(s) RANKS (``all``, or a comma-separated list) send themselves SIGNAL (``SIGTERM``, ...)
from inside the backward pass of their batch number BATCH (counted from 1 over the run), then
the demo goes on as ``python -m tensorplay_mpi.examples.train DEMO-ARGS`` would.
"""

import os
import signal
import sys

from mpi4py import MPI

from tensorplay_mpi.examples import train

name, ranks, batch, *demo = sys.argv[1:]
signals_me = ranks == "all" or str(MPI.COMM_WORLD.rank) in ranks.split(",")
backward, calls = train.backward, [0]


def signalling_backward(*args):
    calls[0] += 1
    if signals_me and calls[0] == int(batch):
        os.kill(os.getpid(), signal.Signals[name])
    return backward(*args)


train.backward = signalling_backward
status = train.main(demo)
if status == train.STOPPED:
    MPI.Finalize()
sys.exit(status)
