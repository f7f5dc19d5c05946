"""Optimizer step benchmark: each step's time as a ratio to the memory-traffic floor.

    OPENBLAS_NUM_THREADS=1 python benchmarks/bench_optim.py --out optim.json

The floor is the time of ``np.add(a, b, out=a)`` on the same number of float32 (3 arrays
moved), scaled to the arrays a step must move: 7 for Adam and AdamW (read p, g, m, v; write p,
m, v), 5 for SGD with momentum (read p, g, b; write p, b).  Every timing is the median over
interleaved repeats (floor, Adam, AdamW, SGD, floor, ...) in one process; targets: Adam and
AdamW <= 2.0, SGD with momentum <= 1.5.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from tensorplay_mpi import SGD, Adam, AdamW

TARGETS = {"adam": 2.0, "adamw": 2.0, "sgd_momentum": 1.5}
ARRAYS = {"adam": 7, "adamw": 7, "sgd_momentum": 5}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=25_000_000)
    parser.add_argument("--pieces", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    sizes = [args.params // args.pieces] * args.pieces
    sizes[-1] += args.params - sum(sizes)
    params = [rng.normal(size=n).astype(np.float32) for n in sizes]
    grads = [rng.normal(scale=1e-3, size=n).astype(np.float32) for n in sizes]
    a = np.ones(args.params, np.float32)
    b = np.ones(args.params, np.float32)
    steps = {
        "adam": Adam(params, grads, lr=1e-4).step,
        "adamw": AdamW(params, grads, lr=1e-4).step,
        "sgd_momentum": SGD(params, grads, lr=1e-4, momentum=0.9).step,
    }
    for step in steps.values():  # first touch of the state, untimed
        step()
    times: dict[str, list[float]] = {"floor": [], **{name: [] for name in steps}}
    for _ in range(args.repeats):
        times["floor"].append(timed(lambda: np.add(a, b, out=a)))
        for name, step in steps.items():
            times[name].append(timed(step))
    median = {name: statistics.median(t) for name, t in times.items()}
    report = {
        "params": args.params, "pieces": args.pieces, "dtype": "float32",
        "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "add_ms": median["floor"] * 1e3,
    }
    for name in steps:
        floor = median["floor"] * ARRAYS[name] / 3
        report[name] = {"ms": median[name] * 1e3, "floor_ms": floor * 1e3,
                        "ratio": median[name] / floor, "target": TARGETS[name]}
        print(f"{name:>13}: {median[name] * 1e3:7.1f} ms = {median[name] / floor:.2f} x the "
              f"floor ({floor * 1e3:.1f} ms; target <= {TARGETS[name]})", flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
