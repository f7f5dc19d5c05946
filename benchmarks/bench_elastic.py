"""An elastic Join with no failure against a plain one: a DataParallel + SGD step, interleaved.

    mpiexec -n 2 python -m mpi4py benchmarks/bench_elastic.py --out elastic-2-ranks.json

Even inputs, NumPy parameters of ``--params`` float64 (default 1M, in 4 arrays), 20 steps per
Join; the two variants alternate for ``--repeats`` repeats (the slowest rank's time of each).
The ratio is of medians, ``elastic / plain`` (target 1.02: "nothing measurable").  With no
failure an elastic Join adds one count read at its entry; the step is the same code.
"""

import argparse
import json
import statistics

import numpy as np
from bench_dp import slowest
from mpi4py import MPI

from tensorplay_mpi import SGD, DataParallel, Join

TARGET = 1.02
STEPS = 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--out")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    params = [np.zeros(args.params // 4) for _ in range(4)]
    dp = DataParallel(params, comm=comm)
    opt = SGD(params, dp.grads, lr=1e-3)

    def epoch(elastic: bool) -> None:
        with Join([dp, opt], elastic=elastic):
            for _ in range(STEPS):
                with dp.step():
                    for k in reversed(range(4)):
                        dp.grads[k][...] = 1.0
                        dp.mark_ready(k)
                opt.step()

    times: dict[str, list[float]] = {"plain": [], "elastic": []}
    epoch(False)  # warm-up
    for _ in range(args.repeats):
        for name, elastic in (("plain", False), ("elastic", True)):
            times[name].append(slowest(comm, lambda e=elastic: epoch(e)) / STEPS)
    medians = {name: statistics.median(t) for name, t in times.items()}
    ratio = medians["elastic"] / medians["plain"]
    if comm.rank == 0:
        print(f"a step at {comm.size} ranks, {args.params:,} parameters: plain "
              f"{medians['plain'] * 1e3:.3f} ms, elastic {medians['elastic'] * 1e3:.3f} ms, "
              f"ratio {ratio:.3f} (target {TARGET})", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"ranks": comm.size, "params": args.params, "steps": STEPS,
                           "median_s": medians, "ratio": ratio, "target": TARGET,
                           "times_s": times}, f, indent=1)


if __name__ == "__main__":
    main()
