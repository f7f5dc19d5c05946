"""Metric sync benchmark: a metric synced each step inside a Join against plain mpi4py.

    mpiexec -n 2 python -m mpi4py benchmarks/bench_metrics.py --out metrics-2-ranks.json

One step of a validation loop: a batch of 32 samples, 10 classes.  Each repeat times,
interleaved, on one communicator (the slowest rank's time per step):

- ``tm_mpi4py``: torchmetrics ``MulticlassAccuracy(dist_sync_on_step=True)`` whose
  ``dist_sync_fn`` is plain mpi4py (``comm.allgather`` of the states), no Join (the baseline;
  it would hang on uneven shards);
- ``tm_join``: the same metric with ``sync_options(jc)`` inside ``Join([jc])``, every rank
  active (:func:`tensorplay_mpi.evaluation.metrics.gather_all_tensors` through the JoinableComm);
- ``tm_join_one_joined``: the same with rank 0 joined from the start (shadowing);
- ``np_mpi4py``: a confusion matrix (int64) and the loss sum (float64) summed with blocking
  ``comm.Allreduce`` (the NumPy baseline);
- ``np_join``: the same states through :func:`tensorplay_mpi.evaluation.metrics.reduce_states`
  and the JoinableComm inside ``Join([jc])``, every rank active.

Ratios are of medians over the repeats: ``tm_join`` and ``tm_join_one_joined`` against
``tm_mpi4py``, ``np_join`` against ``np_mpi4py``.
"""

import argparse
import json
import statistics
import warnings

import numpy as np
import torch
from bench_dp import slowest
from mpi4py import MPI
from torchmetrics.classification import MulticlassAccuracy

from tensorplay_mpi import Join, JoinableComm
from tensorplay_mpi.evaluation.metrics import confusion_matrix, reduce_states, sync_options

BATCH, CLASSES = 32, 10
BASELINES = {"tm_join": "tm_mpi4py", "tm_join_one_joined": "tm_mpi4py", "np_join": "np_mpi4py"}


def variants(comm, jc, steps):
    g = torch.Generator().manual_seed(comm.rank)
    logits = torch.randn(BATCH, CLASSES, generator=g)
    target = torch.randint(0, CLASSES, (BATCH,), generator=g)
    labels, guesses = target.numpy(), logits.argmax(1).numpy()

    def plain_gather(tensor, group=None):
        return [torch.from_numpy(a) for a in comm.allgather(tensor.detach().numpy())]

    def torchmetrics_steps(metric, mine):
        for _ in range(mine):
            if jc.join_context is not None:
                jc.begin_iteration()
            metric(logits, target)

    def tm_mpi4py():
        metric = MulticlassAccuracy(num_classes=CLASSES, dist_sync_on_step=True,
                                    dist_sync_fn=plain_gather,
                                    distributed_available_fn=lambda: True)
        torchmetrics_steps(metric, steps)

    def tm_join(mine):
        metric = MulticlassAccuracy(num_classes=CLASSES, dist_sync_on_step=True,
                                    **sync_options(jc))
        with Join([jc]):
            torchmetrics_steps(metric, mine)

    def np_mpi4py():
        cm, loss = np.empty((CLASSES, CLASSES), np.int64), np.empty(1)
        for _ in range(steps):
            comm.Allreduce(confusion_matrix(labels, guesses, CLASSES), cm, MPI.SUM)
            comm.Allreduce(np.array([1.5]), loss, MPI.SUM)

    def np_join():
        with Join([jc]):
            for _ in range(steps):
                jc.begin_iteration()
                reduce_states({"cm": confusion_matrix(labels, guesses, CLASSES), "loss": 1.5},
                              jc)

    return {"tm_mpi4py": tm_mpi4py, "tm_join": lambda: tm_join(steps),
            "tm_join_one_joined": lambda: tm_join(steps if comm.rank else 0),
            "np_mpi4py": np_mpi4py, "np_join": np_join}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # the Join's input-skew warning, for the joined variant
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    jc = JoinableComm(comm.Dup())
    timed = variants(jc.comm, jc, args.steps)  # one communicator for every variant
    times = {name: [] for name in timed}
    for _ in range(args.repeats):  # interleaved: every variant once per repeat
        for name, fn in timed.items():
            times[name].append(slowest(comm, fn) / args.steps)
    us = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    ratios = {name: us[name] / us[base] for name, base in BASELINES.items()}
    report = {"ranks": comm.size, "steps": args.steps, "repeats": args.repeats,
              "us_per_step": us, "ratios": ratios, "baselines": BASELINES}
    if comm.rank == 0:
        print(f"{comm.size} ranks, us per step: "
              + ", ".join(f"{name} {value:.0f}" for name, value in us.items()))
        print("ratios: " + ", ".join(f"{name}/{BASELINES[name]} {value:.2f}"
                                     for name, value in ratios.items()), flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
