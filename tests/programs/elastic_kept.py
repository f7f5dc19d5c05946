"""A JoinableComm loop that sums its batches into a kept array and loses a rank (``make
test-elastic``): nothing already reduced is lost with it.

    mpiexec --with-ft ulfm -n 3 python tests/programs/elastic_kept.py VICTIM KILL_AT WHEN

Rank ``r`` has ``6 + 8 r`` batches (uneven: the highest rank is the last active one, the others
have joined and shadow); each batch is summed over the ranks into ``total``, kept with
``jc.keep`` in ``Join([jc], elastic=True)``.  The victim SIGKILLs itself at its batch
``KILL_AT``, ``before`` or ``after`` that batch's allreduce.  A survivor whose interrupted batch
was completed by another survivor (``lost.completed``) counts it as summed.  Every survivor then
checks ``total`` against NumPy's sum of every batch of the survivors and the victim's first
``KILL_AT`` (or, when the victim's last allreduce completed, ``KILL_AT + 1``) batches, checks
that the survivors agree, prints ``RESULT rank=R ok`` (or ``WRONG ...``) and exits 0.
"""

import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

from tensorplay_mpi import Join, JoinableComm, RanksLostError


def batches(rank):
    return 6 + 8 * rank


def batch(rank, index):
    """A batch's values: a count, the rank and the index, so a sum says which were summed."""
    return np.array([1.0, rank + 1, index + 1])


def summed(ranks_batches):
    """NumPy's sum of the batches ``(rank, count)``: each rank's first `count` batches."""
    return sum((batch(r, b) for r, n in ranks_batches for b in range(n)), np.zeros(3))


def main():
    victim, kill_at, when = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    world = MPI.COMM_WORLD
    jc = JoinableComm(world)
    total = jc.keep(np.zeros(3))
    done, lost_ranks = 0, []
    while True:  # once, or again on the survivors (every one, batches left or not)
        try:
            with Join([jc], elastic=True):
                while done < batches(world.rank):
                    jc.begin_iteration()
                    if world.rank == victim and done == kill_at and when == "before":
                        die()
                    jc.allreduce(batch(world.rank, done), into=total)
                    if world.rank == victim and done == kill_at and when == "after":
                        die()
                    done += 1
            break
        except RanksLostError as lost:  # jc is on lost.comm already
            print(f"RECOVER rank={world.rank} at {time.time():.6f}", flush=True)
            lost_ranks += lost.lost
            done += lost.completed  # this rank's batch was summed on another survivor
    survivors = [r for r in range(world.size) if r != victim]
    kept = [(r, batches(r)) for r in survivors]
    candidates = [summed(kept + [(victim, k)]) for k in (kill_at, kill_at + 1)]
    problems = []
    if not any(np.array_equal(total, c) for c in candidates[:1 + (when == "after")]):
        problems.append(f"total {total}, expected {candidates[0]}"
                        + (f" or {candidates[1]}" if when == "after" else ""))
    if lost_ranks != [victim]:
        problems.append(f"lost {lost_ranks}, victim {victim}")
    comm = jc.comm  # the survivors'
    if len({bytes(t) for t in comm.allgather(total.tobytes())}) != 1:
        problems.append("the survivors' totals differ")
    verdict = "WRONG " + "; ".join(problems) if problems else "ok"
    print(f"RESULT rank={world.rank} {verdict}", flush=True)


def die():
    print(f"KILLED at {time.time():.6f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
