"""A SyncBatchNorm forward pass outside dp.step() in a later iteration, as rank 0 runs out of
inputs; run under mpiexec by tests/parallel/test_batchnorm.py.

    mpiexec -n 2 python -m mpi4py tests/programs/sbn_outside_step.py before_the_step|no_sync

``Join([dp])`` over a model converted without a group: rank 0 has one batch, the others three;
from the second iteration the forward pass runs before ``dp.step()`` (or under
``dp.no_sync()``), where its statistics belong to no iteration and rank 0, polling in its join
loop, would never shadow them (it hung until the timeout).  Every rank prints ``RESULT rank=R
ExceptionType: message`` in rank order, then raises again so that the job ends non-zero.
"""

import contextlib
import sys

import torch
from mpi4py import MPI
from report import report

from tensorplay_mpi import DataParallel, Join, SyncBatchNorm

world = MPI.COMM_WORLD
comm = world.Dup()
torch.manual_seed(0)
model = SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(
    torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1)).double())
dp = DataParallel(model.parameters(), comm=comm, buffers=model.buffers())
outside = dp.no_sync if sys.argv[1] == "no_sync" else contextlib.nullcontext
error = None
try:
    with Join([dp]):
        for t in range(1 if world.rank == 0 else 3):
            x = torch.randn(5, 4, dtype=torch.float64)
            if t == 0:
                with dp.step():
                    model(x).sum().backward()
                continue
            with outside():
                loss = model(x).sum()
            with dp.step():
                loss.backward()
except Exception as exc:
    error = exc
report(world, error)
