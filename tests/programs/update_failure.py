"""An exception inside ``DataParallel(..., update=fn)`` on rank 0 only; run by test_update.py.

    mpiexec -n 3 python -m mpi4py tests/programs/update_failure.py WHERE

WHERE: ``active`` (rank 0 raises in its second update, at the end of its dp.step()) or
``joined`` (rank 0 has no inputs and raises in its second update, in its shadow of a step).
Every rank prints ``RESULT rank=R ExceptionType: message`` in rank order, then re-raises.
"""

import sys

import torch
from mpi4py import MPI
from report import report

from tensorplay_mpi import DataParallel, Join

where = sys.argv[1]
world = MPI.COMM_WORLD
comm = world.Dup()
torch.manual_seed(0)
model = torch.nn.Linear(3, 2)
calls = []


def update():
    calls.append(1)
    if world.rank == 0 and len(calls) == 2:
        raise ValueError(f"update failed on purpose ({where})")


dp = DataParallel(model.parameters(), comm=comm, update=update)
steps = 0 if where == "joined" and world.rank == 0 else 4
error = None
try:
    with Join([dp]):
        for _ in range(steps):
            model.zero_grad()
            with dp.step():
                model(torch.ones(1, 3)).sum().backward()
except Exception as exc:
    error = exc
report(world, error)
