"""An exception inside ``with dp.step():`` on rank 0 while the last rank has joined; run by
test_data_parallel_failures.py.

    mpiexec -n 2 python -m mpi4py tests/programs/step_failure.py WHERE

WHERE: ``before`` (a user error before the backward pass), ``after`` (after it: a bucket in
flight), ``check`` (the library's own check: a second backward pass in a one-micro-batch step).
Rank 0 raises in its second step; the last rank has no inputs.  Every rank catches its
exception, prints ``RESULT rank=R ExceptionType: message`` in rank order, and exits normally:
the job must then end with status 0, without the library aborting it at exit.
"""

import sys

import torch
from mpi4py import MPI
from report import report

from tensorplay_mpi import DataParallel, Join

where = sys.argv[1]
world = MPI.COMM_WORLD
torch.manual_seed(0)
model = torch.nn.Linear(3, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
dp = DataParallel(model.parameters(), comm=world.Dup(), update=opt.step)
error = None
try:
    with Join([dp]):
        for step in range(0 if world.rank == world.size - 1 else 3):
            fails = world.rank == 0 and step == 1
            model.zero_grad()
            with dp.step():
                if fails and where == "before":
                    raise RuntimeError("user error before the backward pass")
                for _ in range(2 if fails and where == "check" else 1):
                    model(torch.ones(1, 3)).sum().backward()
                if fails and where == "after":
                    raise RuntimeError("user error after the backward pass")
except Exception as exc:
    error = exc
try:
    report(world, error)
except Exception:
    pass  # caught: the program goes on and ends normally
