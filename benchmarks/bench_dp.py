"""DataParallel benchmark: each figure is a ratio of two timings taken side by side in one run.

    mpiexec -n 2 python -m mpi4py benchmarks/bench_dp.py --out dp-2-ranks.json

Every timing is the slowest rank's, the median over interleaved repeats (A, B, B, A, ...);
``--only join,reduce`` measures a subset:

1. ``join``:    step time inside a Join / the same steps without a Join, even inputs (target
                <= 1.02, the goal 1.005);
2. ``reduce``:  DataParallel reduction of all gradients / one raw ``comm.Allreduce(IN_PLACE)``
                of the same bytes (target <= 1.10); ``reduce_vs_manual`` compares with that
                allreduce followed by the division that turns the sum into an average;
3. ``overlap``: step time with ``mark_ready`` / without, compute about as long as the
                communication (target <= 0.9);
4. ``shadow``:  time a joined rank spends in one main-hook round / the active ranks'
                communication time per step (target <= 1.1);
5. ``debug``:   step time with the ``TENSORPLAY_MPI_DEBUG`` signature checks / without (a cost
                to report, no target);
6. ``compress_bf16``, ``compress_fp16``: reduction of all gradients with
                ``compress="bf16"`` (``"fp16"``), half the bytes on the wire and a Python
                reduction operation, / without (no target: DDP's hooks pay off where the
                network, not the CPU, is the bottleneck);
7. ``float16``: reduction of a float16 model's gradients (widened to float32 on the wire) /
                a float32 model's (no target: the same wire, plus the conversions).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import numpy as np
from mpi4py import MPI

from tensorplay_mpi import DataParallel, Join
from tensorplay_mpi.parallel import _reducer as reducer
from tensorplay_mpi.settings import settings

TARGETS = {"join": 1.02, "reduce": 1.10, "reduce_vs_manual": 1.10, "overlap": 0.9,
           "shadow": 1.1, "debug": None, "compress_bf16": None, "compress_fp16": None,
           "float16": None}
PIECES = 8  # parameters per model, equal sizes


def compute(seconds: float, scratch: np.ndarray) -> None:
    """Hold the CPU with NumPy work (no MPI call) for `seconds`."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        np.multiply(scratch, 1.0000001, out=scratch)


def slowest(comm: MPI.Intracomm, fn, setup=None) -> float:
    """Time of `fn` on the slowest rank (`setup` runs first, untimed)."""
    if setup is not None:
        setup()
    comm.Barrier()
    start = time.perf_counter()
    fn()
    return comm.allreduce(time.perf_counter() - start, op=MPI.MAX)


def median_time(comm: MPI.Intracomm, fn, repeats: int, setup=None) -> float:
    """Median over `repeats` of :func:`slowest`."""
    return statistics.median(slowest(comm, fn, setup) for _ in range(repeats))


def side_by_side(comm, a, b, repeats: int, setup=None) -> dict:
    """Median times of `a` and `b`, interleaved in ABBA order, and their ratios.

    ``ratio`` is the ratio of the medians; ``paired_ratio`` the median of the ratios of
    neighbouring samples, which cancels slow drifts of the machine's load.
    """
    times_a, times_b = [], []
    for i in range(repeats):
        first, second = (a, b) if i % 2 == 0 else (b, a)
        t_first, t_second = slowest(comm, first, setup), slowest(comm, second, setup)
        times_a.append(t_first if i % 2 == 0 else t_second)
        times_b.append(t_second if i % 2 == 0 else t_first)
    ta, tb = statistics.median(times_a), statistics.median(times_b)
    paired = statistics.median(x / y for x, y in zip(times_a, times_b))
    return {"a_ms": ta * 1e3, "b_ms": tb * 1e3, "ratio": ta / tb, "paired_ratio": paired}


def bench_size(comm: MPI.Intracomm, total: int, steps: int, repeats: int,
               only: list[str]) -> dict:
    params = [np.zeros(total // PIECES, np.float32) for _ in range(PIECES)]
    dp = DataParallel(params, comm=comm)  # default 25 MiB buckets
    flat = np.ones(total, np.float32)
    scratch = np.ones(1 << 15, np.float32)

    def refill(model: DataParallel) -> None:
        for bucket in model._reducer._buckets:
            bucket.flat.fill(1.0)  # keeps values normal (repeated averaging would denormalise)
            bucket.memory.fill(1.0)  # a float16 bucket's gradients (else flat's)
        flat.fill(1.0)

    def reduce_only(model: DataParallel) -> None:
        with model.step():
            pass

    # the compute of a step lasts about as long as its communication
    comm_s = median_time(comm, lambda: comm.Allreduce(MPI.IN_PLACE, flat), repeats)

    def train(model: DataParallel, join: bool, overlap: bool) -> None:
        with Join([model]) if join else contextlib.nullcontext():
            for _ in range(steps):
                refill(model)
                with model.step():
                    for i in reversed(range(PIECES)):
                        compute(comm_s / PIECES, scratch)
                        if overlap:
                            model.mark_ready(i)

    def overlap() -> dict:
        split = DataParallel(params, comm=comm, bucket_cap_mb=params[0].nbytes / 2**20)
        return side_by_side(comm, lambda: train(split, True, True),
                            lambda: train(split, True, False), repeats)

    def against_plain(other: DataParallel) -> dict:
        """A step of `other` reducing every gradient / the same step of `dp`."""
        def setup() -> None:
            refill(other)
            refill(dp)
        return side_by_side(comm, lambda: reduce_only(other), lambda: reduce_only(dp),
                            repeats, setup=setup)

    ratios = {
        "join": lambda: side_by_side(comm, lambda: train(dp, True, False),
                                     lambda: train(dp, False, False), repeats),
        "reduce": lambda: side_by_side(comm, lambda: reduce_only(dp),
                                       lambda: comm.Allreduce(MPI.IN_PLACE, flat), repeats,
                                       setup=lambda: refill(dp)),
        "reduce_vs_manual": lambda: side_by_side(
            comm, lambda: reduce_only(dp),
            lambda: (comm.Allreduce(MPI.IN_PLACE, flat), np.divide(flat, comm.size, out=flat)),
            repeats, setup=lambda: refill(dp)),
        "overlap": overlap,
        "shadow": lambda: shadow_ratio(comm, dp, steps, repeats, reduce_only, refill),
        "debug": lambda: side_by_side(
            comm, lambda: debug_mode(True, lambda: train(dp, True, False)),
            lambda: train(dp, True, False), repeats),
        "compress_bf16": lambda: against_plain(DataParallel(params, comm=comm, compress="bf16")),
        "compress_fp16": lambda: against_plain(DataParallel(params, comm=comm, compress="fp16")),
        "float16": lambda: against_plain(DataParallel(
            [np.zeros(p.size, np.float16) for p in params], comm=comm)),
    }

    results = {name: ratios[name]() for name in only}
    return results


def debug_mode(on: bool, fn) -> None:
    """Run `fn` with TENSORPLAY_MPI_DEBUG's signature checks switched `on`."""
    previous = os.environ.get("TENSORPLAY_MPI_DEBUG", "0")
    os.environ["TENSORPLAY_MPI_DEBUG"] = "1" if on else "0"
    settings.cache_clear()
    try:
        fn()
    finally:
        os.environ["TENSORPLAY_MPI_DEBUG"] = previous
        settings.cache_clear()


def shadow_ratio(comm, dp: DataParallel, steps: int, repeats: int, reduce_only, refill) -> dict:
    """Rank 0 joins at once; it times its main hooks, the others their steps."""
    hook_class = reducer._ShadowHook
    original, spent = hook_class.main_hook, []

    def timed_main_hook(self):
        start = time.perf_counter()
        original(self)
        spent.append(time.perf_counter() - start)

    hook_class.main_hook = timed_main_hook
    try:
        step_times = []
        for _ in range(repeats):
            comm.Barrier()
            with Join([dp]):
                for _ in range(steps if comm.rank else 0):
                    refill(dp)
                    start = time.perf_counter()
                    reduce_only(dp)
                    step_times.append(time.perf_counter() - start)
    finally:
        hook_class.main_hook = original
    round_s = comm.bcast(statistics.median(spent) if comm.rank == 0 else None, root=0)
    active = comm.allgather(statistics.median(step_times) if comm.rank else None)
    step_s = max(t for t in active if t is not None)
    return {"a_ms": round_s * 1e3, "b_ms": step_s * 1e3, "ratio": round_s / step_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000000,25000000", help="float32 parameter counts")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--only", default=",".join(TARGETS),
                        help="comma-separated ratios to measure (default: all)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if comm.size < 2:
        raise SystemExit("run under mpiexec with at least 2 ranks")
    report = {
        "ranks": comm.size,
        "cores": os.cpu_count(),
        "oversubscribed": comm.size > (os.cpu_count() or 1),
        "async_progress": os.environ.get("MPIR_CVAR_ASYNC_PROGRESS") == "1",
        "mpi": MPI.Get_library_version().splitlines()[0].strip(),
        "targets": TARGETS,
        "sizes": {},
    }
    for total in (int(s) for s in args.sizes.split(",")):
        report["sizes"][str(total)] = bench_size(comm, total, args.steps, args.repeats,
                                                 args.only.split(","))
        if comm.rank == 0:
            row = report["sizes"][str(total)]
            print(f"{comm.size} ranks, {total:>10,} params: " + "  ".join(
                f"{k} {row[k]['ratio']:.3f}" + (f" (paired {row[k]['paired_ratio']:.3f})"
                                                 if "paired_ratio" in row[k] else "")
                for k in TARGETS if k in row), flush=True)
    if comm.rank == 0:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
