"""GPU bucket reduction: DataParallel on 25M float32 CuPy parameters (``make gpu-check``).

    mpiexec -n 2 python -m mpi4py benchmarks/bench_gpu.py --out gpu-2-ranks.json

For host-staged mode (and CUDA-aware mode where MPI reports it): the median time of one
``dp.step()`` reduction, its GB/s (parameter bytes / time), its ratio to a plain
device-to-host plus host-to-device copy of the same bytes through a pinned buffer, and its
ratio to MPI's own allreduce of the same bytes in host memory (the staged path's floor: copies
plus that allreduce).
"""

import argparse
import json
import os

import cupy
import cupyx
import numpy as np
from bench_dp import median_time
from mpi4py import MPI

from tensorplay_mpi import DataParallel, Join
from tensorplay_mpi.comm import cuda_aware
from tensorplay_mpi.testing import reset_settings


def synchronised(fn):
    """`fn` followed by a device synchronisation, so that its time includes the GPU's work."""
    def run():
        fn()
        cupy.cuda.get_current_stream().synchronize()
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=25_000_000)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    cupy.cuda.Device(comm.rank % cupy.cuda.runtime.getDeviceCount()).use()
    grad = cupy.ones(args.params, cupy.float32)
    pinned = cupyx.empty_pinned(args.params, cupy.float32)

    def copy_round_trip():
        grad.get(out=pinned)
        grad.set(pinned)

    copy_s = median_time(comm, synchronised(copy_round_trip), args.repeats)
    host = np.ones(args.params, np.float32)
    host_s = median_time(comm, lambda: comm.Iallreduce(MPI.IN_PLACE, host, MPI.SUM).Wait(),
                         args.repeats)
    aware, why = cuda_aware()
    modes = {"staged": False} | ({"cuda_aware": True} if aware else {})
    report = {"ranks": comm.size, "params": args.params, "bytes": grad.nbytes,
              "cuda_aware_detected": aware, "why": why, "copy_round_trip_ms": copy_s * 1e3,
              "host_allreduce_ms": host_s * 1e3, "modes": {}}
    for mode, use_device_pointers in modes.items():
        os.environ["TENSORPLAY_MPI_CUDA_AWARE"] = "1" if use_device_pointers else "0"
        reset_settings()  # the next cuda_aware() reads the mode just set
        assert cuda_aware()[0] == use_device_pointers
        params = [cupy.zeros(args.params, cupy.float32)]
        dp = DataParallel(params, comm=comm)

        def step():
            with dp.step():
                dp.grads[0].fill(1.0)

        with Join([dp]):
            step_s = median_time(comm, synchronised(step), args.repeats)
        report["modes"][mode] = {"step_ms": step_s * 1e3, "GB_per_s": grad.nbytes / step_s / 1e9,
                                 "ratio_to_copy_round_trip": step_s / copy_s,
                                 "ratio_to_host_allreduce": step_s / host_s}
    if comm.rank == 0:
        print(json.dumps(report, indent=2), flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
