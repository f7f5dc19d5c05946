"""Every rank raises the same error inside a step while its buckets are in flight; run under
mpiexec by test_data_parallel_failures.py, with MPIR_CVAR_ASYNC_PROGRESS=1 so that ranks have
started different numbers of bucket allreduces when they raise.

    MPIR_CVAR_ASYNC_PROGRESS=1 mpiexec -n 3 python -m mpi4py tests/programs/dp_recovery.py

Each rank prints ``RESULT rank=R ok`` when all 20 trials ended in its own exception with no
operation pending and the next Join averaged exactly, else what went wrong.
"""

import time

import numpy as np
from mpi4py import MPI

from tensorplay_mpi import DataParallel, Join
from tensorplay_mpi.comm import outstanding_requests

comm = MPI.COMM_WORLD.Dup()
rng = np.random.default_rng(comm.rank)
dp = DataParallel([np.zeros(20_000) for _ in range(8)], comm=comm, bucket_cap_mb=0.1)
problems = []
for trial in range(20):
    try:
        with Join([dp]):
            with dp.step():
                for i in reversed(range(8)):
                    time.sleep(rng.uniform(0, 2e-4))  # a backward pass of uneven speed
                    dp.mark_ready(i)
                raise KeyError(f"the same bug in trial {trial}")
    except KeyError as exc:
        if f"trial {trial}" not in str(exc):
            problems.append(f"trial {trial}: caught {exc!r}")
    if outstanding_requests():
        problems.append(f"trial {trial}: {outstanding_requests()} operations pending")
with Join([dp]):
    for _ in range(1 + comm.rank):
        with dp.step():
            for g in dp.grads:
                g[...] = 1.0
if not all(np.all(g == 1.0 / comm.size) for g in dp.grads):  # the last step: one rank active
    problems.append(f"next Join: grads {[g[:2].tolist() for g in dp.grads]}")
print(f"RESULT rank={comm.rank} {'; '.join(problems) or 'ok'}", flush=True)
