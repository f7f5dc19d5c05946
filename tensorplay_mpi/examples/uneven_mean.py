"""Exact global mean and variance of a data set that ranks stream in uneven chunks.

Run::

    mpiexec -n 4 python -m mpi4py -m tensorplay_mpi.examples.uneven_mean --idle-rank0

Each rank streams its own share of the chunks (rank ``r`` gets a share proportional to
``r + 1``; with ``--idle-rank0`` rank 0 gets none).  A custom Joinable, ``StreamingMoments``,
folds every chunk of every rank into the global count, mean and variance with one collective
per chunk: an allgather of each rank's ``(count, mean, M2)``, merged in rank order with Chan's
formula, so every rank holds the same numbers.  A rank that runs out of chunks shadows the
allgather with an empty contribution until every rank is done.  Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from mpi4py import MPI

from tensorplay_mpi import Join, Joinable, JoinHook
from tensorplay_mpi.comm import default_comm, iallgather
from tensorplay_mpi.data import shard

MOMENTS = np.dtype([("count", np.int64), ("mean", np.float64), ("m2", np.float64)])


class StreamingMoments(Joinable):
    """Running count, mean and sum of squared deviations over all ranks' chunks.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm, optional
        Defaults to ``MPI.COMM_WORLD``.
    """

    def __init__(self, comm: MPI.Intracomm | None = None) -> None:
        super().__init__()
        self.comm = comm if comm is not None else default_comm()
        self.count, self.mean, self.m2 = 0, 0.0, 0.0
        self._mine = np.zeros(1, MOMENTS)
        self._all = np.zeros(self.comm.Get_size(), MOMENTS)

    @property
    def variance(self) -> float:
        """Population variance (``ddof=0``, as ``numpy.var``)."""
        return self.m2 / self.count if self.count else float("nan")

    def update(self, chunk: np.ndarray) -> None:
        """Fold one local chunk into the global moments.

        Collective over ``comm``: every rank still holding data calls it once per chunk.
        """
        Join.notify_join_context(self)
        mean = float(chunk.mean()) if chunk.size else 0.0
        self._exchange(chunk.size, mean, float(((chunk - mean) ** 2).sum()))

    def _exchange(self, count: int, mean: float, m2: float) -> None:
        self._mine[0] = (count, mean, m2)
        iallgather(self.comm, self._mine.view(np.uint8), self._all.view(np.uint8)).wait()
        for count_b, mean_b, m2_b in self._all.tolist():  # rank order: same result everywhere
            if count_b:
                total = self.count + count_b
                delta = mean_b - self.mean
                self.mean += delta * count_b / total
                self.m2 += m2_b + delta * delta * self.count * count_b / total
                self.count = total

    def join_hook(self, **kwargs) -> JoinHook:
        return _EmptyContribution(self)

    @property
    def join_device(self) -> str:
        return "cpu"

    @property
    def join_process_group(self) -> MPI.Intracomm:
        return self.comm


class _EmptyContribution(JoinHook):
    def __init__(self, moments: StreamingMoments) -> None:
        self.moments = moments

    def main_hook(self) -> None:
        self.moments._exchange(0, 0.0, 0.0)


def make_data(samples: int, seed: int) -> np.ndarray:
    """The data set: far from zero, so that a naive sum of squares would lose digits."""
    return np.random.default_rng(seed).normal(loc=1e4, scale=3.0, size=samples)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=100_003)
    parser.add_argument("--chunk", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--idle-rank0", action="store_true", help="rank 0 gets no data")
    args = parser.parse_args(argv)

    comm = default_comm()
    data = make_data(args.samples, args.seed)
    chunks = [data[i:i + args.chunk] for i in range(0, data.size, args.chunk)]
    mine = [chunks[i] for i in shard(len(chunks), comm.rank, comm.size, skew=1.0,
                                     idle=[0] if args.idle_rank0 and comm.size > 1 else [])]
    moments = StreamingMoments(comm)
    with Join([moments]):
        for chunk in mine:
            moments.update(chunk)
    report = {"ranks": comm.size, "chunks": comm.gather(len(mine)), "count": moments.count,
              "mean": moments.mean, "variance": moments.variance}
    if comm.rank == 0:
        print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
