"""Exactness soak at many ranks (``make soak-32``): DataParallel, then DataParallel beside
JoinableComm, with uneven inputs, against independent computations.

    mpiexec -n 32 python -m mpi4py tests/programs/soak.py

1. SGD on linear least squares inside ``Join([dp])``, rank r with ``1 + r % 5`` batches and
   rank 0 with none, for both divisors: the params equal a serial replay (rtol 1e-12) and are
   bitwise identical on every rank;
2. ``Join([dp, jc])``, rank r with ``r % 7`` iterations: every iteration averages integer-valued
   gradients and sums the iteration count with ``jc.allreduce``: both equal their closed forms
   exactly, for every iteration of every rank.

Prints ``SOAK OK ranks=N`` on rank 0 and exits 0, or names every failing rank and exits 1.
"""

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from linear import make_problem, replay, train  # noqa: E402

from tensorplay_mpi import DataParallel, Join, JoinableComm  # noqa: E402

comm = MPI.COMM_WORLD.Dup()
rank, size = comm.rank, comm.size
failures = []

inputs = [0] + [1 + r % 5 for r in range(1, size)]
data = make_problem(samples=8 * sum(inputs))
for divide in (True, False):
    params, _ = train(comm, data, inputs, divide_by_initial_world_size=divide,
                      bucket_cap_mb=1e-6)
    expected = replay(data, inputs, divide_by_initial_world_size=divide)
    if not all(np.allclose(p, e, rtol=1e-12, atol=0) for p, e in zip(params, expected)):
        failures.append(f"SGD (divide_by_initial_world_size={divide}) differs from the replay")
    every = comm.allgather(b"".join(p.tobytes() for p in params))
    if any(b != every[0] for b in every):
        failures.append(f"SGD (divide_by_initial_world_size={divide}): params differ by rank")

iterations = [r % 7 for r in range(size)]
dp = DataParallel([np.zeros(3), np.zeros(5)], comm=comm, bucket_cap_mb=1e-6)
jc = JoinableComm(comm)
with Join([dp, jc], divide_by_initial_world_size=False):
    for t in range(iterations[rank]):
        active = [r for r in range(size) if iterations[r] > t]
        with dp.step():
            for g in dp.grads:
                g[...] = rank + t
        jc.begin_iteration()
        count = jc.allreduce(np.array([1], dtype=np.int64))
        if count[0] != len(active):
            failures.append(f"iteration {t}: jc counted {count[0]} active, not {len(active)}")
        mean = sum(r + t for r in active) / len(active)
        if any(not np.all(g == mean) for g in dp.grads):
            failures.append(f"iteration {t}: grads {[g.tolist() for g in dp.grads]} != {mean}")

bad = [f"rank {r}: {f}" for r, fs in enumerate(comm.allgather(failures)) for f in fs]
if rank == 0:
    print("\n".join(bad) if bad else f"SOAK OK ranks={size}", flush=True)
sys.exit(1 if bad else 0)
