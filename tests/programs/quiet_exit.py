"""How a job ends, counted in lines: a stop as docs/stopping.md ends one, and an exception in one
rank's loop; run under mpiexec by tests/process/test_process.py.

    mpiexec -n 3 python -m mpi4py tests/programs/quiet_exit.py MODE

A JoinableComm loop (rank r has 20 + r iterations: the last ones with ranks joined) issues an
allreduce of float64 and one of int64 and a broadcast in each iteration (persistent
collectives, where MPI has them).  MODE:
  stop   rank 0 requests a stop in iteration 5; every rank prints ``RESULT rank=R stopped at
         I`` and ends as docs/stopping.md says: ``exit_for_requeue()`` (MPI finalized, status 75)
  raise  rank 1 raises ValueError in iteration 3, uncaught (the others raise a
         PeerFailureError in their next library wait)
"""

import sys

import numpy as np
from mpi4py import MPI

from tensorplay_mpi import Join, JoinableComm, exit_for_requeue, request_stop

mode = sys.argv[1]
world = MPI.COMM_WORLD
jc = JoinableComm(world)
with Join([jc]) as join:
    for iteration in range(20 + world.rank):
        if join.stopped:
            break
        jc.begin_iteration()
        jc.allreduce(np.ones(3))
        jc.allreduce(np.ones(4, np.int64))
        jc.bcast(np.ones(2), root=0)
        if mode == "stop" and iteration == 5 and world.rank == 0:
            request_stop("the test")
        if mode == "raise" and iteration == 3 and world.rank == 1:
            raise ValueError("boom in iteration 3")
print(f"RESULT rank={world.rank} stopped at {iteration}", flush=True)
exit_for_requeue()
