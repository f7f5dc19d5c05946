"""ZeroRedundancyOptimizer benchmark: optimizer-state memory per rank and step time.

    mpiexec -n 2 python -m mpi4py benchmarks/bench_zero.py --out zero-2-ranks.json

- ``state_share``: this rank's Adam state bytes / a local Adam's (target <= 1/W + 0.05), the
  largest over ranks;
- ``step``: step time of ``Join([dp, zero])`` / ``Join([dp, adam])`` with a local Adam, measured
  side by side (slowest rank, median of interleaved repeats);
- ``many_small``: for each count in ``--small`` (1k to 10k params of 100 float32), a ZeRO SGD
  step / a local SGD step on the same params, side by side (target at 10k: <= 1.5);
- ``copies``: the step time of ``Join([dp, zero], elastic=True)`` with ``copies=True`` (each
  rank also steps the copy of the previous rank's shard) / ``Join([dp, zero])`` without, on
  even inputs, side by side; and the state bytes per rank with / without.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
from bench_dp import side_by_side
from mpi4py import MPI

from tensorplay_mpi import SGD, Adam, DataParallel, Join, ZeroRedundancyOptimizer

SMALL_TARGET = 1.5  # ZeRO / local step with 10k small params


def model(total: int) -> list[np.ndarray]:
    """`total` float32 parameters in 16 arrays of uneven sizes (as layers are)."""
    weights = np.arange(1, 17, dtype=float)
    sizes = np.floor(weights / weights.sum() * total).astype(int)
    sizes[-1] += total - sizes.sum()
    return [np.zeros(int(n), np.float32) for n in sizes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=25_000_000)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--small", default="1000,2500,5000,10000",
                        help="counts of small params (comma-separated; empty: none)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    many_small = {}
    for count in [int(n) for n in args.small.split(",") if n]:
        small = [np.zeros(100, np.float32) for _ in range(count)]
        grads = [np.full_like(p, 1e-3) for p in small]
        zero_sgd = ZeroRedundancyOptimizer(small, grads, SGD, comm=comm, lr=1e-3)
        local_sgd = SGD(small, grads, lr=1e-3)
        many_small[count] = side_by_side(comm, zero_sgd.step, local_sgd.step, args.repeats)
        if comm.rank == 0:
            print(f"{comm.size} ranks, {count} params of 100 float32: ZeRO SGD step / local "
                  f"{many_small[count]['ratio']:.2f} ({many_small[count]['a_ms']:.1f} / "
                  f"{many_small[count]['b_ms']:.1f} ms)", flush=True)

    params = model(args.params)
    dp_zero, dp_local = DataParallel(params, comm=comm), DataParallel(params, comm=comm)
    zero = ZeroRedundancyOptimizer(params, dp_zero.grads, Adam, comm=comm, lr=1e-3)
    local = Adam(params, dp_local.grads, lr=1e-3)
    share = comm.allreduce(zero.state_nbytes / local.state_nbytes, op=MPI.MAX)

    def train(dp, optimizer) -> None:
        with Join([dp, optimizer]):
            for _ in range(args.steps):
                with dp.step():
                    pass
                optimizer.step()

    step = side_by_side(comm, lambda: train(dp_zero, zero), lambda: train(dp_local, local),
                        args.repeats)

    dp_copies = DataParallel(params, comm=comm)
    with_copies = ZeroRedundancyOptimizer(params, dp_copies.grads, Adam, comm=comm, lr=1e-3,
                                          copies=True)

    def train_elastic(dp, optimizer) -> None:
        with Join([dp, optimizer], elastic=True):
            for _ in range(args.steps):
                with dp.step():
                    pass
                optimizer.step()

    copies = side_by_side(comm, lambda: train_elastic(dp_copies, with_copies),
                          lambda: train(dp_zero, zero), args.repeats)
    copies["state_bytes_ratio"] = comm.allreduce(with_copies.state_nbytes / zero.state_nbytes,
                                                 op=MPI.MAX)
    report = {
        "ranks": comm.size,
        "cores": os.cpu_count(),
        "oversubscribed": comm.size > (os.cpu_count() or 1),
        "params": args.params,
        "local_state_bytes": local.state_nbytes,
        "max_sharded_state_bytes": comm.allreduce(zero.state_nbytes, op=MPI.MAX),
        "state_share": share,
        "state_share_target": 1 / comm.size + 0.05,
        "step": step,
        "many_small": many_small,
        "copies": copies,
        "many_small_target": SMALL_TARGET,
    }
    if comm.rank == 0:
        print(f"{comm.size} ranks: state share {share:.4f} (target <= "
              f"{report['state_share_target']:.4f}), step Join([dp, zero]) / Join([dp, adam]) "
              f"{step['ratio']:.3f} ({step['a_ms']:.0f} / {step['b_ms']:.0f} ms); with copies "
              f"(elastic) / without {copies['ratio']:.3f}, paired {copies['paired_ratio']:.3f} "
              f"({copies['a_ms']:.0f} / {copies['b_ms']:.0f} ms), state bytes "
              f"{copies['state_bytes_ratio']:.2f}x", flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
