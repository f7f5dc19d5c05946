"""A rank SIGKILLed mid-run, under Open MPI's fault-tolerant launch (``make test-elastic``).

    mpiexec --with-ft ulfm -n 3 python tests/programs/lost_rank.py WHERE

The last rank kills itself at iteration 20 of a Join, WHERE:

  step    every rank active, in DataParallel's step (a bucket allreduce, the heartbeat)
  joined  rank 0 has run out of inputs and shadows the others' steps
  jc      a JoinableComm loop (an allreduce each iteration)

Each survivor prints ``RESULT rank=R ok ...`` if it raised PeerFailureError naming the lost rank
within seconds, else ``RESULT rank=R WRONG ...``, then exits normally (status 0): nothing of the
library may be left pending on the revoked communicator, or the exit hook would abort the job
(a nonzero status).
"""

import os
import re
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

from tensorplay_mpi import DataParallel, Join, JoinableComm, PeerFailureError

DEADLINE_S = 10.0


def loop(where, comm):
    """Run WHERE's Join until the last rank dies; the number of iterations done."""
    lost = comm.size - 1
    if where == "jc":
        jc = JoinableComm(comm)
        with Join([jc]):
            for i in range(1000):
                if comm.rank == lost and i == 20:
                    os.kill(os.getpid(), signal.SIGKILL)
                jc.begin_iteration()
                jc.allreduce(np.ones(4))
                time.sleep(0.002)
        return
    dp = DataParallel([np.zeros(1000)], comm=comm)
    steps = 10 if where == "joined" and comm.rank == 0 else 1000
    with Join([dp]):
        for i in range(steps):
            if comm.rank == lost and i == 20:
                os.kill(os.getpid(), signal.SIGKILL)
            with dp.step():
                dp.grads[0][...] = 1.0
            time.sleep(0.002)


def main():
    where = sys.argv[1]
    comm = MPI.COMM_WORLD
    start = time.perf_counter()
    try:
        loop(where, comm)
        verdict, detail = "WRONG", "the loop ended without an error"
    except PeerFailureError as error:
        found = re.search(r"rank\(s\) \[([\d, ]*)\]", str(error))
        named = found is not None and str(comm.size - 1) in found.group(1).split(", ")
        verdict = "ok" if named and time.perf_counter() - start < DEADLINE_S else "WRONG"
        detail = str(error)
    except BaseException as error:  # a raw MPI error, or anything else: not what users get
        verdict, detail = "WRONG", f"{type(error).__name__}: {error}"
    print(f"RESULT rank={comm.rank} {verdict} {where} after "
          f"{time.perf_counter() - start:.2f} s: {detail[:200]}", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
