"""JoinableComm benchmark: per-iteration cost against raw mpi4py nonblocking calls.

    mpiexec -n 2 python -m mpi4py benchmarks/bench_jc.py --out jc-2-ranks.json

The schedule of one iteration: an allreduce (SUM) of 8 (then 100,000) float64, an allreduce (MAX)
of one int64, a broadcast of 4 float64 from the highest rank.  Raw: ``Iallreduce``/``Ibcast`` and
``Wait`` on the same communicator.  JoinableComm: ``begin_iteration()`` and the same three inside
a Join (one heartbeat more).  Ratios of medians over interleaved repeats, all ranks active
(target <= 1.15) and with rank 0 joined from the start (reported; joined ranks are shadowed
through announcements).
"""

import argparse
import json

import numpy as np
from bench_dp import median_time
from mpi4py import MPI

from tensorplay_mpi import Join, JoinableComm


def raw(comm, iterations, elements):
    s, m, b = np.ones(elements), np.ones(1, np.int64), np.ones(4)
    out_s, out_m = np.empty_like(s), np.empty_like(m)
    for _ in range(iterations):
        comm.Iallreduce(s, out_s, MPI.SUM).Wait()
        comm.Iallreduce(m, out_m, MPI.MAX).Wait()
        comm.Ibcast(b, comm.size - 1).Wait()


def joinable(jc, iterations, elements):
    s, m, b = np.ones(elements), np.ones(1, np.int64), np.ones(4)
    out_s, out_m, out_b = np.empty_like(s), np.empty_like(m), np.empty_like(b)
    with Join([jc]):
        for _ in range(iterations):
            jc.begin_iteration()
            jc.allreduce(s, out=out_s)  # as raw mpi4py, into buffers made once
            jc.allreduce(m, MPI.MAX, out=out_m)
            jc.bcast(b, root="highest_active", out=out_b)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    jc = JoinableComm(comm.Dup())
    plain = jc.comm  # the same communicator: MPICH runs collectives at different speeds on
    # different communicators (a duplicate of COMM_WORLD was 3x slower for 800 KB here)
    n = args.iterations
    report = {"ranks": comm.size, "target_all_active": 1.15, "schedules": {}}
    for elements in (8, 100_000):
        raw_s = median_time(comm, lambda: raw(plain, n, elements), args.repeats) / n
        active_s = median_time(comm, lambda: joinable(jc, n, elements), args.repeats) / n
        joined_s = median_time(comm, lambda: joinable(jc, n if comm.rank else 0, elements),
                               args.repeats) / n
        report["schedules"][f"sum of {elements} float64"] = {
            "raw_us": raw_s * 1e6, "all_active_us": active_s * 1e6,
            "one_joined_us": joined_s * 1e6, "all_active_ratio": active_s / raw_s,
            "one_joined_ratio": joined_s / raw_s}
    if comm.rank == 0:
        print(json.dumps(report), flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
