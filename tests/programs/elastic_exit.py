"""A JoinableComm loop that loses a rank, then exits with a chosen status (``make test-elastic``,
``elastic_exit_trials.py``).

    mpiexec --with-ft ulfm -n 3 python tests/programs/elastic_exit.py VICTIM WHEN STATUS EXIT

Each rank runs ``ITERATIONS + rank`` iterations of ``jc.allreduce`` (uneven: lower ranks join
first and shadow) in ``Join([jc], elastic=True)``, a new Join on the survivors after a loss.
The victim (a rank of COMM_WORLD) SIGKILLs itself at iteration ``KILL_AT``, ``before`` or
``after`` that iteration's allreduce.  Every survivor checks each sum it got (the number of
ranks active in that iteration: at most the world size, at least one) and that the lost rank
is the victim, prints ``RESULT rank=R ok`` (or ``WRONG ...``) and ``EXIT rank=R STATUS at T``,
then exits with STATUS: ``sys.exit(STATUS)``, MPI finalized at exit (EXIT ``atexit``), or after
``MPI.Finalize()`` (EXIT ``explicit``, as docs/stopping.md's stop does).
"""

import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

from tensorplay_mpi import Join, JoinableComm, RanksLostError

ITERATIONS, KILL_AT = 30, 10


def main():
    victim, when, status, how = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    world = MPI.COMM_WORLD
    jc = JoinableComm(world)
    done, problems, lost_ranks = 0, [], []
    while done < ITERATIONS + world.rank:
        try:
            with Join([jc], elastic=True):
                while done < ITERATIONS + world.rank:
                    jc.begin_iteration()
                    if world.rank == victim and done == KILL_AT and when == "before":
                        die()
                    total = jc.allreduce(np.ones(2))
                    if world.rank == victim and done == KILL_AT and when == "after":
                        die()
                    if not (1 <= total[0] <= world.size and total[0] == total[1]):
                        problems.append(f"iteration {done}: sum {total}")
                    done += 1
        except RanksLostError as lost:
            lost_ranks += lost.lost  # jc is on lost.comm already; the iteration is redone
    if lost_ranks != [victim]:
        problems.append(f"lost {lost_ranks}, victim {victim}")
    verdict = "WRONG " + "; ".join(problems) if problems else "ok"
    print(f"RESULT rank={world.rank} {verdict}", flush=True)
    print(f"EXIT rank={world.rank} {status} at {time.time():.6f}", flush=True)
    if how == "explicit":
        MPI.Finalize()
    sys.exit(status)


def die():
    print(f"KILLED at {time.time():.6f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
