"""JoinableComm benchmark: per-iteration cost against plain blocking mpi4py, side by side.

    mpiexec -n 2 python -m mpi4py benchmarks/bench_jc.py --out jc-2-ranks.json

The schedule of one iteration: an allreduce (SUM) of 8 (then 100,000) float64, an allreduce (MAX)
of one int64, a broadcast of 4 float64 from the highest rank, every result into a buffer made
once.  Each repeat times, interleaved, on one communicator (the slowest rank's time):

- ``blocking``: ``comm.Allreduce``/``comm.Bcast``, plain blocking mpi4py (the baseline);
- ``nonblocking``: the same through ``Iallreduce``/``Ibcast`` + ``Wait``;
- ``floor_all_active``: ``nonblocking`` plus the Join's heartbeat, an ``Iallreduce`` of one
  int64: what a Join with every rank active needs at the least, without any Python;
- ``floor_one_joined``: the collectives of an iteration with a rank joined, without any Python:
  the heartbeat, an announcement (``Iallreduce`` of 42 int64, MAX) that carries the SUM where
  every rank's values fit its slots (8 float64 up to 4 ranks; else the SUM follows it), one
  announcement that carries the MAX, one that carries the broadcast, and END;
- ``jc_outside``: ``jc.allreduce``/``jc.bcast`` outside any Join;
- ``jc_all_active``: ``begin_iteration()`` and the same three inside ``Join([jc])``;
- ``jc_one_joined``: the same with rank 0 joined from the start (shadowing); at 2 ranks the
  other rank is then the last active one, whose operations need no collective after the first
  iteration (only the heartbeat and END remain), so ``floor_one_joined`` is the floor of 3
  ranks and more.

Ratios are of medians over the repeats, each against ``blocking`` (targets: 2.0 with every rank
active, 2.5 with one rank joined).
"""

import argparse
import json
import statistics
import warnings

import numpy as np
from bench_dp import slowest
from mpi4py import MPI

from tensorplay_mpi import Join, JoinableComm
from tensorplay_mpi.algorithms._announcements import PAYLOAD, SLOTS

TARGETS = {"jc_all_active": 2.0, "jc_one_joined": 2.5}


def schedules(comm, jc, iterations, elements):
    """The timed variants: name -> function running `iterations` iterations."""
    s, m, b = np.ones(elements), np.ones(1, np.int64), np.ones(4)
    out_s, out_m, out_b = np.empty_like(s), np.empty_like(m), np.empty_like(b)
    last = comm.size - 1
    word, words = np.ones(1, np.int64), np.empty(1, np.int64)
    header = np.zeros(SLOTS, np.int64)

    def blocking():
        for _ in range(iterations):
            comm.Allreduce(s, out_s, MPI.SUM)
            comm.Allreduce(m, out_m, MPI.MAX)
            comm.Bcast(b, last)

    def nonblocking(heartbeat=False):
        for _ in range(iterations):
            if heartbeat:
                comm.Iallreduce(word, words, MPI.SUM).Wait()
            comm.Iallreduce(s, out_s, MPI.SUM).Wait()
            comm.Iallreduce(m, out_m, MPI.MAX).Wait()
            comm.Ibcast(b, last).Wait()

    def floor_one_joined():
        for _ in range(iterations):
            comm.Iallreduce(word, words, MPI.SUM).Wait()
            comm.Iallreduce(MPI.IN_PLACE, header, MPI.MAX).Wait()
            if elements * comm.size > PAYLOAD:  # else the SUM travels in the announcement
                comm.Iallreduce(s, out_s, MPI.SUM).Wait()
            for _ in range(3):  # the MAX, the broadcast, END
                comm.Iallreduce(MPI.IN_PLACE, header, MPI.MAX).Wait()

    def ops():
        jc.allreduce(s, out=out_s)
        jc.allreduce(m, MPI.MAX, out=out_m)
        jc.bcast(b, root="highest_active", out=out_b)

    def jc_outside():
        for _ in range(iterations):
            ops()

    def in_join(mine):
        with Join([jc]):
            for _ in range(mine):
                jc.begin_iteration()
                ops()

    return {
        "blocking": blocking,
        "nonblocking": nonblocking,
        "floor_all_active": lambda: nonblocking(heartbeat=True),
        "floor_one_joined": floor_one_joined,
        "jc_outside": jc_outside,
        "jc_all_active": lambda: in_join(iterations),
        "jc_one_joined": lambda: in_join(iterations if comm.rank else 0),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # the Join's input-skew warning, for the joined variant
    comm = MPI.COMM_WORLD
    jc = JoinableComm(comm.Dup())
    plain = jc.comm  # the same communicator: MPICH runs collectives at different speeds on
    # different communicators (a duplicate of COMM_WORLD was 3x slower for 800 KB here)
    n = args.iterations
    report = {"ranks": comm.size, "targets": TARGETS, "schedules": {}}
    for elements in (8, 100_000):
        variants = schedules(plain, jc, n, elements)
        times = {name: [] for name in variants}
        for _ in range(args.repeats):  # interleaved: every variant once per repeat
            for name, fn in variants.items():
                times[name].append(slowest(comm, fn) / n)
        us = {name: statistics.median(t) * 1e6 for name, t in times.items()}
        report["schedules"][f"sum of {elements} float64"] = {
            "us": us, "ratio_to_blocking": {k: v / us["blocking"] for k, v in us.items()}}
    if comm.rank == 0:
        for schedule, result in report["schedules"].items():
            ratios = ", ".join(f"{name} {ratio:.2f}"
                               for name, ratio in result["ratio_to_blocking"].items()
                               if name != "blocking")
            print(f"{comm.size} ranks, {schedule}: {result['us']['blocking']:.1f} us blocking; "
                  f"ratios {ratios} (targets {TARGETS})", flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
