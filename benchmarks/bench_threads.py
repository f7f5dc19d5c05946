"""BLAS threads: a DataParallel step in the default environment against OPENBLAS_NUM_THREADS=1.

    python benchmarks/bench_threads.py --ranks 2 --out benchmarks/results/threads-2-ranks.json

Thread counts are fixed when a process loads its BLAS, so the environments are compared across
launches: ``mpiexec -n RANKS`` runs of the worker, interleaved (default, OPENBLAS_NUM_THREADS=1,
TENSORPLAY_MPI_THREADS=keep, default, ...).  Each run times the training step of an MLP with
1M float32 parameters (1000-1000-10, batch 64, gradients reduced through ``mark_ready``) inside a
Join: the slowest rank's median over 30 steps.  Reported: the medians over the launches and the
ratio default / OPENBLAS_NUM_THREADS=1 (target <= 1.3 at 2 ranks); ``keep`` shows the cost of an
unlimited BLAS, what the library did before it limited the threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ENVIRONMENTS = {
    "default": {},
    "OPENBLAS_NUM_THREADS=1": {"OPENBLAS_NUM_THREADS": "1"},
    "TENSORPLAY_MPI_THREADS=keep": {"TENSORPLAY_MPI_THREADS": "keep"},
}
_CHOSEN = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "TENSORPLAY_MPI_THREADS")


def worker(steps: int) -> None:
    """Under mpiexec: print the slowest rank's median step time in ms (rank 0)."""
    import time

    import numpy as np
    from mpi4py import MPI

    from tensorplay_mpi import DataParallel, Join
    from tensorplay_mpi.examples.train import backward, init_mlp

    comm = MPI.COMM_WORLD
    params = init_mlp(1000, 1000, 10, seed=0)
    dp = DataParallel(params, comm=comm)
    rng = np.random.default_rng(comm.rank)
    x = rng.random((64, 1000), dtype=np.float32)
    y = rng.integers(0, 10, 64)
    times = []
    with Join([dp]):
        for _ in range(steps + 3):
            start = time.perf_counter()
            with dp.step():
                backward(params, x, y, dp)
            for p, g in zip(params, dp.grads):
                p -= 1e-3 * g
            times.append(time.perf_counter() - start)
    slowest = comm.reduce(statistics.median(times[3:]), op=MPI.MAX)
    if comm.rank == 0:
        print(json.dumps({"step_ms": slowest * 1e3}))


def launch(ranks: int, env: dict[str, str], steps: int) -> float:
    mpiexec = os.environ.get("MPIEXEC") or os.path.join(os.path.dirname(sys.executable),
                                                        "mpiexec")
    environ = {k: v for k, v in os.environ.items() if k not in _CHOSEN}
    result = subprocess.run([mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi4py",
                             __file__, "--worker", "--steps", str(steps)],
                            capture_output=True, text=True, timeout=300, env={**environ, **env})
    if result.returncode != 0:
        raise SystemExit(f"worker failed ({env}):\n{result.stdout}\n{result.stderr}")
    return float(json.loads(result.stdout.strip().splitlines()[-1])["step_ms"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--launches", type=int, default=5, help="per environment, interleaved")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps)
        return
    times: dict[str, list[float]] = {name: [] for name in ENVIRONMENTS}
    for _ in range(args.launches):
        for name, env in ENVIRONMENTS.items():
            times[name].append(launch(args.ranks, env, args.steps))
    medians = {name: statistics.median(t) for name, t in times.items()}
    report = {
        "ranks": args.ranks,
        "usable_cores": len(os.sched_getaffinity(0)),
        "step_ms": medians,
        "runs_ms": times,
        "default / OPENBLAS_NUM_THREADS=1 (target <= 1.3)":
            medians["default"] / medians["OPENBLAS_NUM_THREADS=1"],
        "keep / OPENBLAS_NUM_THREADS=1":
            medians["TENSORPLAY_MPI_THREADS=keep"] / medians["OPENBLAS_NUM_THREADS=1"],
    }
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as out:
            json.dump(report, out, indent=1)


if __name__ == "__main__":
    main()
