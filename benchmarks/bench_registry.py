"""Registry benchmark: many operations, waited by another thread, some dropped, against raw mpi4py.

    mpiexec -n 2 python -m mpi4py benchmarks/bench_registry.py --out registry-2-ranks.json

The case: the main thread starts ``--ops`` small allreduces (8 float64 each); a helper thread
waits for three of every four, in start order, through a queue of at most 64 (a pipeline: the
main thread runs at most 64 operations ahead); the fourth is dropped (the library owns it and
completes it when the registry is progressed).  Raw mpi4py cannot drop a request, so its helper
waits for every one (kept until the end instead, thousands of requests pending in MPICH make
every MPI call slower: quadratic in raw mpi4py too).  The variants run interleaved, on one
communicator (the slowest rank's time):

- ``raw``: ``comm.Iallreduce`` and ``Request.Wait`` in the helper, for every request;
- ``library``: :func:`tensorplay_mpi.comm.iallreduce` and ``Work.wait`` in the helper, the
  dropped Works completed by the library (``complete_pending`` at the end).

The ratio is of medians over the repeats, ``library / raw`` (target: 2.0), with the number of
request tests the registry's sweeps did per operation (it stays flat: O(1) amortised a start).
The same pair runs again with the helper's lag uncapped (``ratio_unbounded``): everything may
pile up, in MPI as in the registry (raw mpi4py grows faster than linearly there too).
"""

import argparse
import json
import queue
import statistics
import threading

import numpy as np
from bench_dp import slowest
from mpi4py import MPI

from tensorplay_mpi.comm import _work as registry
from tensorplay_mpi.comm import iallreduce

TARGET = 2.0


def run(comm: MPI.Intracomm, ops: int, library: bool, lag: int = 64) -> None:
    """Start `ops` allreduces here, wait three of four in a helper thread (at most `lag`
    behind; 0: no cap), drop the fourth."""
    waits: queue.Queue = queue.Queue(maxsize=lag)

    def helper() -> None:
        while (item := waits.get()) is not None:
            item.wait() if library else item.Wait()

    thread = threading.Thread(target=helper)
    thread.start()
    for i in range(ops):
        send, recv = np.ones(8), np.empty(8)
        if library:
            work = iallreduce(comm, send, recv, MPI.SUM, "registry bench")
            if i % 4 != 3:
                waits.put(work)
        else:  # an mpi4py request keeps its buffers alive
            waits.put(comm.Iallreduce(send, recv, MPI.SUM))
    waits.put(None)
    thread.join()
    if library:
        registry.complete_pending(None, 60.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", type=int, default=30_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    times: dict[str, list[float]] = {name: [] for name in
                                     ("raw", "library", "raw unbounded", "library unbounded")}
    tests_per_op = []
    for _ in range(args.repeats):  # interleaved
        for lag, suffix in ((64, ""), (0, " unbounded")):  # the helper's lag capped, or not
            times["raw" + suffix].append(slowest(comm, lambda: run(comm, args.ops, False, lag)))
            before = registry.sweep_tests()
            times["library" + suffix].append(slowest(comm, lambda: run(comm, args.ops, True,
                                                                       lag)))
            tests_per_op.append((registry.sweep_tests() - before) / args.ops)
    s = {name: statistics.median(t) for name, t in times.items()}
    report = {"ranks": comm.size, "ops": args.ops, "target": TARGET, "seconds": s,
              "ratio": s["library"] / s["raw"],
              "ratio_unbounded": s["library unbounded"] / s["raw unbounded"],
              "sweep_tests_per_op": max(tests_per_op)}
    if comm.rank == 0:
        print(f"{comm.size} ranks, {args.ops} operations (a fourth dropped, the rest waited by a "
              f"helper thread): raw {s['raw']:.2f} s, library {s['library']:.2f} s, ratio "
              f"{report['ratio']:.2f}; unbounded lag: raw {s['raw unbounded']:.2f} s, library "
              f"{s['library unbounded']:.2f} s, ratio {report['ratio_unbounded']:.2f} (target "
              f"{TARGET} each); registry tests per operation "
              f"{report['sweep_tests_per_op']:.2f}", flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
