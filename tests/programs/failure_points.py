"""Every rank raises, at chosen protocol points; run under mpiexec by test_failure_points.py.

    mpiexec -n 3 python -m mpi4py tests/programs/failure_points.py FIRST OTHERS
    mpiexec -n 3 python -m mpi4py tests/programs/failure_points.py count

Rank 0 raises KeyError just before it starts library collective number FIRST on the loop's
communicator (counted from 0 after the joinables are made), every other rank just before
number OTHERS: inside a heartbeat,
a bucket, a step control, an optimizer's broadcast, a JoinableComm announcement, wherever the
numbers fall.  The loop: DataParallel (two buckets) with SGD, then a JoinableComm loop, both on
uneven inputs.  Each rank prints ``RESULT rank=R Type: message`` for what it caught, then tries
a follow-up Join on the same communicator and prints ``FOLLOWUP rank=R total=T expected=E`` or
``FOLLOWUP rank=R Type: message``.  ``count`` prints ``COLLECTIVES n`` for a run without
failures.
"""

import sys

import numpy as np
from mpi4py import MPI

from tensorplay_mpi import SGD, DataParallel, Join, JoinableComm
from tensorplay_mpi.comm._guard import Guard

world = MPI.COMM_WORLD
comm = world.Dup()
rank, size = comm.rank, comm.size
point = None if sys.argv[1] == "count" else int(sys.argv[1 if rank == 0 else 2])
limit = None  # armed once the joinables are made
before_collective = Guard.before_collective


def failing_before(guard, kind, what, signature, description=None):
    global limit
    if guard is Guard.of(comm) and kind not in ("send", "recv") and guard.started == limit:
        limit = None  # once
        raise KeyError(f"injected on rank {rank} before collective {point} ({what})")
    before_collective(guard, kind, what, signature, description)


Guard.before_collective = failing_before


params = [np.zeros(3), np.zeros(2)]
dp = DataParallel(params, comm=comm, bucket_cap_mb=16 / 2**20)  # one bucket per param
opt = SGD(params, dp.grads, lr=0.5, momentum=0.9)
jc = JoinableComm(comm)
made = Guard.of(comm).started  # the collectives of construction are not counted
limit = None if point is None else made + point


def loop():
    with Join([dp, opt]):
        for i in range(2 + rank):
            with dp.step():
                for k, grad in enumerate(dp.grads):
                    grad[...] = rank + i + k
                    dp.mark_ready(k)
            opt.step()
    with Join([jc]):
        for i in range(1 + rank):
            jc.begin_iteration()
            jc.allreduce(np.full(2, float(rank)))
            jc.allgather(np.full((1, 2), i))


def followup():
    with Join([jc]):
        for _ in range(1 + rank):
            jc.begin_iteration()
            total = jc.allreduce(np.ones(1))
    return int(total[0]), size - rank  # iteration i (the last: i == rank) has size - i ranks


if point is None:
    loop()
    print(f"COLLECTIVES {Guard.of(comm).started - made}", flush=True)
    sys.exit(0)
caught = None
try:
    loop()
except Exception as error:  # noqa: BLE001 - what every rank caught is the result
    caught = error
limit = None  # a rank that caught another rank's failure first never reached its own point
world.Barrier()
for r in range(size):
    if r == rank:
        print(f"RESULT rank={rank} {type(caught).__name__}: {caught}", flush=True)
    world.Barrier()
try:
    total, expected = followup()
    outcome = f"total={total} expected={expected}"
except Exception as error:  # noqa: BLE001
    outcome = f"{type(error).__name__}: {error}"
world.Barrier()
for r in range(size):
    if r == rank:
        print(f"FOLLOWUP rank={rank} {outcome}", flush=True)
    world.Barrier()
