"""JoinableComm misused beside DataParallel; run under mpiexec by test_joinable_comm_misuse_mpi.py.

    mpiexec -n 2 python -m mpi4py tests/programs/jc_misuse.py

``Join([dp, jc])`` with rank 0 out of inputs after one iteration, and the JoinableComm operation
issued inside ``dp.step()``: against the list order, so a joined rank's DataParallel hook meets
an announcement.  Every rank prints ``RESULT rank=R ExceptionType: message`` (or ``ok``) in rank
order, then raises again so that the job ends non-zero.
"""


import numpy as np
from mpi4py import MPI
from report import report

from tensorplay_mpi import DataParallel, Join, JoinableComm

world = MPI.COMM_WORLD
comm = world.Dup()
dp = DataParallel([np.zeros(300)], comm=comm)
jc = JoinableComm(comm)
error = None
try:
    with Join([dp, jc]):
        for _ in range(1 if world.rank == 0 else 3):
            with dp.step():
                dp.grads[0] = np.ones(300)
                jc.begin_iteration()
                jc.allreduce(np.ones(2))
except Exception as exc:
    error = exc
report(world, error)
