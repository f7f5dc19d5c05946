"""Scientific loops with uneven work: JoinableComm against the same user's hand-written padding.

    mpiexec -n 2 python -m mpi4py benchmarks/bench_science.py --out science-2-ranks.json

Two loops, each written twice, timed interleaved on one communicator (the slowest rank's time
per iteration of the longest rank):

- Monte Carlo: each iteration draws ``points`` random points, counts those inside the unit
  circle and sums ``[inside, points]`` over the ranks into a running total;
- mini-batch k-means: each iteration assigns ``points`` points to 5 centroids (2-d) and sums the
  per-cluster sums and counts over the ranks into running totals (two allreduces); the
  centroids are the running means.

``jc``: as docs/joinable_comm.md shows: ``Join([jc])``, ``jc.begin_iteration()``, the sums
``jc.allreduce(..., into=kept)`` into arrays kept with ``jc.keep`` (every rank holds the final
totals).  ``padding``: the hand-written version: the ranks agree on the longest rank's number of
iterations (one ``comm.allreduce``), and a rank out of work sends zeros (``comm.Allreduce`` into
a buffer, then ``+=``).  Rank ``r`` has ``iterations * (1 + r)`` iterations, so ranks join at
different times.  The sizes are chosen for iterations of about 50-100 us and about 0.5 ms here;
the JSON has every size's times and ratios (``jc / padding``).
"""

import argparse
import json
import statistics

import numpy as np
from bench_dp import slowest
from mpi4py import MPI

from tensorplay_mpi import Join, JoinableComm

SIZES = {"monte_carlo": [(1_500, "about 50-100 us"), (14_000, "about 0.5 ms")],
         "kmeans": [(128, "about 50-100 us"), (2_400, "about 0.5 ms")]}
TARGETS = {"about 50-100 us": 1.3, "about 0.5 ms": 1.1}


def monte_carlo_step(rng, points):
    x = rng.random((points, 2))
    return np.array([np.count_nonzero((x * x).sum(axis=1) <= 1.0), points], np.float64)


def kmeans_step(rng, points, centroids):
    x = rng.normal(size=(points, 2)) * 3.0
    nearest = ((x[:, None, :] - centroids[None]) ** 2).sum(axis=2).argmin(axis=1)
    sums = np.zeros_like(centroids)
    np.add.at(sums, nearest, x)
    return sums, np.bincount(nearest, minlength=len(centroids)).astype(np.float64)


def means(initial, sums, counts):
    centroids = initial.copy()
    moved = counts > 0
    centroids[moved] = sums[moved] / counts[moved, None]
    return centroids


def variants(comm, loop, points, mine):
    """name -> (setup, run): `run` runs this rank's `mine` iterations; `setup` (untimed) makes
    the JoinableComm and keeps its arrays (``keep`` registers arrays once per JoinableComm)."""
    initial = np.random.default_rng(0).normal(size=(5, 2)) * 3.0
    made = {}

    def setup_monte_carlo():
        made["jc"] = JoinableComm(comm)
        made["total"] = made["jc"].keep(np.zeros(2))

    def jc_monte_carlo():
        rng, jc, total = np.random.default_rng(comm.rank), made["jc"], made["total"]
        with Join([jc]):
            for _ in range(mine):
                jc.begin_iteration()
                jc.allreduce(monte_carlo_step(rng, points), into=total)

    def padding_monte_carlo():
        rng = np.random.default_rng(comm.rank)
        total, summed = np.zeros(2), np.empty(2)
        for t in range(comm.allreduce(mine, op=MPI.MAX)):
            part = monte_carlo_step(rng, points) if t < mine else np.zeros(2)
            comm.Allreduce(part, summed, MPI.SUM)
            total += summed

    def setup_kmeans():
        made["jc"] = JoinableComm(comm)
        made["sums"], made["counts"] = made["jc"].keep(np.zeros((5, 2)), np.zeros(5))

    def jc_kmeans():
        rng, jc, sums, counts = (np.random.default_rng(comm.rank), made["jc"], made["sums"],
                                 made["counts"])
        with Join([jc]):
            for _ in range(mine):
                jc.begin_iteration()
                part_sums, part_counts = kmeans_step(rng, points, means(initial, sums, counts))
                jc.allreduce(part_sums, into=sums)
                jc.allreduce(part_counts, into=counts)

    def padding_kmeans():
        rng = np.random.default_rng(comm.rank)
        sums, counts = np.zeros((5, 2)), np.zeros(5)
        summed_sums, summed_counts = np.empty((5, 2)), np.empty(5)
        zero_sums, zero_counts = np.zeros((5, 2)), np.zeros(5)
        for t in range(comm.allreduce(mine, op=MPI.MAX)):
            if t < mine:
                part_sums, part_counts = kmeans_step(rng, points, means(initial, sums, counts))
            else:
                part_sums, part_counts = zero_sums, zero_counts
            comm.Allreduce(part_sums, summed_sums, MPI.SUM)
            comm.Allreduce(part_counts, summed_counts, MPI.SUM)
            sums += summed_sums
            counts += summed_counts

    if loop == "monte_carlo":
        return {"jc": (setup_monte_carlo, jc_monte_carlo), "padding": (None, padding_monte_carlo)}
    return {"jc": (setup_kmeans, jc_kmeans), "padding": (None, padding_kmeans)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    mine = args.iterations * (1 + comm.rank)
    longest = args.iterations * comm.size
    report = {"ranks": comm.size, "targets": TARGETS, "loops": {}}
    plain = comm.Dup()  # one communicator for both variants (MPICH's speed differs by one)
    for loop, sizes in SIZES.items():
        for points, regime in sizes:
            fns = variants(plain, loop, points, mine)
            times = {name: [] for name in fns}
            for _ in range(args.repeats):  # interleaved: every variant once per repeat
                for name, (setup, run) in fns.items():
                    times[name].append(slowest(comm, run, setup) / longest)
            us = {name: statistics.median(t) * 1e6 for name, t in times.items()}
            report["loops"][f"{loop}, {points} points"] = {
                "regime": regime, "us_per_iteration": us, "ratio": us["jc"] / us["padding"]}
    if comm.rank == 0:
        for name, result in report["loops"].items():
            us = result["us_per_iteration"]
            print(f"{comm.size} ranks, {name} ({result['regime']}): padding {us['padding']:.1f} "
                  f"us, jc {us['jc']:.1f} us per iteration: ratio {result['ratio']:.2f} (target "
                  f"{TARGETS[result['regime']]})", flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
