"""A JoinableComm operation inside dp.step(); run under mpiexec by test_joinable_comm_misuse.py.

    mpiexec -n 2 python -m mpi4py tests/programs/jc_misuse.py

``Join([dp, jc])`` with rank 0 out of inputs after one iteration, and the JoinableComm operation
issued inside ``dp.step()`` (once refused: a joined rank's DataParallel hook met the
announcement).  The stream orders them: the sums count the active ranks and the gradients are
averaged over the world size.  Every rank prints ``RESULT rank=R ExceptionType: message`` (or
``ok``) in rank order, then raises again so that the job ends non-zero.
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
        for t in range(1 if world.rank == 0 else 3):
            with dp.step():
                dp.grads[0][...] = 1.0
                jc.begin_iteration()
                total = jc.allreduce(np.ones(2))
            active = world.size if t == 0 else world.size - 1
            if not (total == active).all() or not (dp.grads[0] == active / world.size).all():
                raise AssertionError(f"step {t}: sum {total}, gradient {dp.grads[0][0]}; "
                                     f"{active} active ranks")
except Exception as exc:
    error = exc
report(world, error)
