"""Which path do messages between the ranks of this node take?  (``make test-noshm``)

    MPIR_CVAR_NOLOCAL=1 UCX_TLS=tcp,self mpiexec -n 2 python -m mpi4py tests/programs/transport.py

Prints, on rank 0, how many ranks each rank sees on its node (``MPI_Comm_split_type`` with
``COMM_TYPE_SHARED``: 1 once MPICH treats every rank as remote) and the round-trip time of an
8-byte message between ranks 0 and 1.  With ``--expect-remote`` it exits 1 unless every rank
sees itself alone on its node.
"""

import sys
import time

import numpy as np
from mpi4py import MPI

world = MPI.COMM_WORLD
local = world.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
every = world.allgather(local)


def round_trip_us(rounds: int) -> float:
    """Mean round trip of an 8-byte message between ranks 0 and 1."""
    message = np.zeros(1)
    world.Barrier()
    start = time.perf_counter()
    for _ in range(rounds if world.size > 1 and world.rank < 2 else 0):
        if world.rank == 0:
            world.Send(message, 1)
            world.Recv(message, 1)
        else:
            world.Recv(message, 0)
            world.Send(message, 0)
    return (time.perf_counter() - start) / rounds * 1e6


round_trip_us(200)  # warm-up: connections, caches
measured = round_trip_us(2000)
if world.rank == 0:
    print(f"node-local ranks seen by each rank: {every}; 8-byte round trip between ranks 0 "
          f"and 1: {measured:.1f} us ({MPI.Get_library_version().splitlines()[0]})",
          flush=True)
remote = all(n == 1 for n in every)
sys.exit(0 if remote or "--expect-remote" not in sys.argv else 1)
