"""Mini-batch k-means on uneven shards with JoinableComm: no custom hook.

Run::

    mpiexec -n 4 python -m mpi4py -m tensorplay_mpi.examples.kmeans --idle-rank0

Each rank holds a different number of points (rank ``r`` a share proportional to ``1 + r``; with
``--idle-rank0`` rank 0 holds none) and walks through them in mini-batches.  In iteration ``t``
every rank that still has a batch assigns its points to the nearest centroid; two allreduces
add the points and counts per cluster over the active ranks into running totals, and every
centroid is the mean of all points assigned to it so far.  A rank out of batches is shadowed by
JoinableComm, so the result is the serial run's on all the data: in iteration ``t`` it
processes the ``t``-th batches of all ranks together.  The running totals are kept arrays
(``jc.keep``): a rank that has joined adds the same results to its own, so after the Join every
rank holds the final centroids, with no broadcast.  Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
from functools import reduce

import numpy as np
from mpi4py import MPI

from tensorplay_mpi import Join, JoinableComm
from tensorplay_mpi.data import batches, shard


def make_data(points: int, clusters: int, dim: int, seed: int) -> np.ndarray:
    """Points around `clusters` random centres, in a random order."""
    rng = np.random.default_rng(seed)
    centres = rng.uniform(-10, 10, size=(clusters, dim))
    labels = rng.integers(clusters, size=points)
    return centres[labels] + rng.normal(size=(points, dim))


def rank_batches(data: np.ndarray, rank: int, size: int, batch: int,
                 idle_rank0: bool) -> list[np.ndarray]:
    """Rank `rank`'s points, in mini-batches."""
    mine = shard(len(data), rank, size, skew=1.0, idle=[0] if idle_rank0 and size > 1 else [])
    return [data[idx] for idx in batches(mine, batch)]


def cluster_sums(points: np.ndarray, centroids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per cluster: the sum of the points nearest to it, and their number."""
    nearest = ((points[:, None, :] - centroids[None]) ** 2).sum(axis=2).argmin(axis=1)
    sums = np.zeros_like(centroids)
    np.add.at(sums, nearest, points)
    return sums, np.bincount(nearest, minlength=len(centroids)).astype(np.int64)


def means(initial: np.ndarray, sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Each centroid: the mean of every point assigned to it so far, else where it started."""
    centroids = initial.copy()
    moved = counts > 0
    centroids[moved] = sums[moved] / counts[moved, None]
    return centroids


def serial_kmeans(per_rank: list[list[np.ndarray]], initial: np.ndarray) -> np.ndarray:
    """The same iterations on one process: iteration t takes every rank's t-th batch."""
    sums, counts = np.zeros_like(initial), np.zeros(len(initial), np.int64)
    for t in range(max(len(b) for b in per_rank)):
        centroids = means(initial, sums, counts)
        parts = [cluster_sums(b[t], centroids) for b in per_rank if t < len(b)]
        sums += reduce(np.add, (p[0] for p in parts))
        counts += reduce(np.add, (p[1] for p in parts))
    return means(initial, sums, counts)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", type=int, default=5000)
    parser.add_argument("--clusters", type=int, default=5)
    parser.add_argument("--dim", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--idle-rank0", action="store_true", help="rank 0 holds no points")
    args = parser.parse_args(argv)

    comm = MPI.COMM_WORLD
    data = make_data(args.points, args.clusters, args.dim, args.seed)
    mine = rank_batches(data, comm.rank, comm.size, args.batch, args.idle_rank0)
    initial = data[:args.clusters].copy()  # every rank starts from the same points
    jc = JoinableComm(comm)
    # The running totals, kept current on every rank (a rank that has joined too).
    sums, counts = jc.keep(np.zeros_like(initial), np.zeros(args.clusters, np.int64))
    with Join([jc]):
        for points in mine:
            jc.begin_iteration()
            batch_sums, batch_tally = cluster_sums(points, means(initial, sums, counts))
            jc.allreduce(batch_sums, into=sums)
            jc.allreduce(batch_tally, into=counts)
    centroids = means(initial, sums, counts)  # the same on every rank
    batch_counts = comm.allgather(len(mine))
    identical = len(set(comm.allgather(centroids.tobytes()))) == 1
    report = {"ranks": comm.size, "batches": batch_counts, "centroids": centroids.tolist(),
              "identical_on_every_rank": identical}
    if comm.rank == 0:
        print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
