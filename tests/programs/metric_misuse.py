"""A torchmetrics metric pickled with ``sync_options(jc)`` and loaded again (its group not given
back: it syncs over ``MPI.COMM_WORLD``), synced inside a running Join after rank 0 has joined;
run under mpiexec by tests/evaluation/test_metrics_edges.py.

    mpiexec -n 3 python -m mpi4py tests/programs/metric_misuse.py

Rank r runs 1 + r iterations and the metric syncs from the second one on, so every rank but
rank 0 is active at the first sync and rank 0 is in its join loop.  A sync that returns prints
``VALUE rank=R x``; then every rank prints its outcome (``RESULT rank=R ...``) and raises it
again.
"""

import pickle

import torch
from mpi4py import MPI
from report import report
from torchmetrics.classification import MulticlassAccuracy

from tensorplay_mpi import Join, JoinableComm
from tensorplay_mpi.evaluation.metrics import sync_options

world = MPI.COMM_WORLD
jc = JoinableComm(world)
metric = pickle.loads(pickle.dumps(MulticlassAccuracy(
    num_classes=3, average="micro", dist_sync_on_step=True, **sync_options(jc))))
error = None
try:
    with Join([jc]):
        for step in range(1 + world.rank):
            jc.begin_iteration()
            if step >= 1:
                value = metric(torch.tensor([0, 1]), torch.tensor([0, 2]))
                print(f"VALUE rank={world.rank} {float(value)}", flush=True)
except Exception as raised:
    error = raised
report(world, error)
