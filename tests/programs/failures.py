"""A data-parallel loop that goes wrong on purpose; run under mpiexec by test_failures.py.

    mpiexec -n 3 python -m mpi4py tests/programs/failures.py MODE

MODE (rank 1 misbehaves in iteration 3 of 10):
  raise     raises ValueError inside dp.step()
  kill      is killed with SIGKILL
  stall     sleeps instead of stepping (run with a small TENSORPLAY_MPI_TIMEOUT)
  mismatch  issues an extra collective (run with TENSORPLAY_MPI_DEBUG=1)

Every rank that catches an exception prints ``RESULT rank=R ExceptionType: message`` in rank
order, then raises it again so that the job ends non-zero.
"""

import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI
from report import report

from tensorplay_mpi import DataParallel, Join
from tensorplay_mpi.comm import iallreduce

mode = sys.argv[1]
world = MPI.COMM_WORLD
comm = world.Dup()
dp = DataParallel([np.zeros(4)], comm=comm)
error = None
try:
    with Join([dp]):
        for iteration in range(1, 11):
            misbehaves = world.rank == 1 and iteration == 3
            if misbehaves and mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if misbehaves and mode == "stall":
                time.sleep(120)
            if misbehaves and mode == "mismatch":
                iallreduce(comm, np.ones(3), np.empty(3)).wait()
            with dp.step():
                dp.grads[0] = np.full(4, float(world.rank))
                if misbehaves and mode == "raise":
                    raise ValueError(f"boom in iteration {iteration}")
except Exception as exc:
    error = exc
report(world, error)
