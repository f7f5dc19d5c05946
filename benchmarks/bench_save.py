"""The cost of periodic checkpoints inside a Join: ratios of timings taken side by side.

    mpiexec -n 2 python -m mpi4py benchmarks/bench_save.py --out save-2-ranks.json

Even inputs, DataParallel + SGD (momentum) in a Join, float32 models of ``--sizes`` parameters.
Three variants of the same ``--steps`` steps, interleaved (A, B, C, C, B, A, ...), each timing
the slowest rank's, the median over ``--repeats``:

- ``plain``:   no ``on_save``;
- ``armed``:   ``on_save`` given, no save requested (what arming periodic saves costs a step);
- ``saving``:  a save requested every ``--every`` steps (``checkpoint.save`` of the parameters
               and the optimizer state from ``on_save``).

Reports ``armed / plain``, ``saving / plain``, each save's time (``Saved.seconds``, the median)
and bytes written.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time

import numpy as np
from mpi4py import MPI

from tensorplay_mpi import SGD, DataParallel, Join, checkpoint, clear_save, request_save

PIECES = 4


def run(comm, params, dp, opt, steps, mode, every, directory, saves):
    def on_save():
        saves.append(checkpoint.save(directory, params, optimizer=opt, step=join.iterations,
                                     comm=comm))

    comm.Barrier()
    start = time.perf_counter()
    with Join([dp, opt], on_save=None if mode == "plain" else on_save) as join:
        for i in range(steps):
            with dp.step():
                for g in dp.grads:
                    g.fill(1e-6)
            opt.step()
            if mode == "saving" and (i + 1) % every == 0:
                request_save("bench")
    elapsed = time.perf_counter() - start
    clear_save()
    return comm.allreduce(elapsed, op=MPI.MAX)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="100000,1000000", help="float32 parameter counts")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True)
    options = parser.parse_args()
    comm = MPI.COMM_WORLD
    directory = comm.bcast(tempfile.mkdtemp(prefix="bench-save-") if comm.rank == 0 else None)
    results = []
    for size in (int(s) for s in options.sizes.split(",")):
        params = [np.zeros(size // PIECES, np.float32) for _ in range(PIECES)]
        dp = DataParallel(params, comm=comm)
        opt = SGD(params, dp.grads, lr=0.01, momentum=0.9)
        times = {"plain": [], "armed": [], "saving": []}
        saves = []
        modes = list(times)
        run(comm, params, dp, opt, options.steps, "saving", options.every, directory, [])
        for k in range(options.repeats):
            for mode in modes if k % 2 == 0 else modes[::-1]:
                times[mode].append(run(comm, params, dp, opt, options.steps, mode,
                                       options.every, directory, saves))
        median = {mode: statistics.median(t) for mode, t in times.items()}
        row = {
            "parameters": size, "ranks": comm.size, "steps": options.steps,
            "every": options.every,
            "step_ms": {m: 1e3 * t / options.steps for m, t in median.items()},
            "armed_over_plain": median["armed"] / median["plain"],
            "saving_over_plain": median["saving"] / median["plain"],
            "save_ms_median": 1e3 * statistics.median(s.seconds for s in saves),
            "save_bytes": saves[-1].nbytes,
        }
        results.append(row)
        if comm.rank == 0:
            print(f"{comm.size} ranks, {size} parameters: step {row['step_ms']['plain']:.2f} ms; "
                  f"armed/plain {row['armed_over_plain']:.3f}, saving every {options.every}/"
                  f"plain {row['saving_over_plain']:.3f}; a save {row['save_ms_median']:.1f} ms, "
                  f"{row['save_bytes'] / 2**20:.2f} MiB", flush=True)
    if comm.rank == 0:
        with open(options.out, "w") as f:
            json.dump({"benchmark": "save", "results": results}, f, indent=1)
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
