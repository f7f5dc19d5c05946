"""A demo, sent a real signal at a chosen batch: a deterministic stop for the tests.

    mpiexec -n N python -m mpi4py tests/programs/stop_demo.py DEMO SIGNAL RANKS BATCH ARGS...

DEMO is ``train`` or ``train_torch`` (of ``tensorplay_mpi.examples``).  Rank(s) RANKS (``all``,
or a comma-separated list) send themselves SIGNAL (``SIGTERM``, ...) from inside the backward
pass (``train``) or the forward pass (``train_torch``) of their batch number BATCH (counted from
1 over the run), then the demo goes on as ``python -m tensorplay_mpi.examples.DEMO ARGS`` would.
"""

import importlib
import os
import signal
import sys

from mpi4py import MPI

HOOKED = {"train": "backward", "train_torch": "loss_of"}  # called once a batch by each demo

demo_name, name, ranks, batch, *args = sys.argv[1:]
demo = importlib.import_module(f"tensorplay_mpi.examples.{demo_name}")
signals_me = ranks == "all" or str(MPI.COMM_WORLD.rank) in ranks.split(",")
hooked, calls = getattr(demo, HOOKED[demo_name]), [0]


def signalling(*hooked_args):
    calls[0] += 1
    if signals_me and calls[0] == int(batch):
        os.kill(os.getpid(), signal.Signals[name])
    return hooked(*hooked_args)


setattr(demo, HOOKED[demo_name], signalling)
status = demo.main(args)
if status == demo.STOPPED:
    MPI.Finalize()
sys.exit(status)
