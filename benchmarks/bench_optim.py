"""Optimizer step benchmark: each step's time as a ratio to the memory-traffic floor.

    OPENBLAS_NUM_THREADS=1 python benchmarks/bench_optim.py --out optim.json

The floor is the time of ``np.add(a, b, out=a)`` on the same number of float32 (3 arrays
moved), scaled to the arrays a step must move: 7 for Adam and AdamW (read p, g, m, v; write p,
m, v), 5 for SGD with momentum (read p, g, b; write p, b).  Every timing is the median over
interleaved repeats (floor, Adam, AdamW, SGD, floor, ...) in one process; targets: Adam and
AdamW <= 2.0, SGD with momentum <= 1.5.  The ratio of the fastest repeats is reported too: on a
shared machine it is the better estimate of the uncontended cost.  ``adam_whole_arrays`` is the
same Adam written with whole-array expressions (a temporary per operation, the library's code
before the block-wise rules), for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from tensorplay_mpi import SGD, Adam, AdamW

TARGETS = {"adam": 2.0, "adamw": 2.0, "sgd_momentum": 1.5, "adam_whole_arrays": None}
ARRAYS = {"adam": 7, "adamw": 7, "sgd_momentum": 5, "adam_whole_arrays": 7}


def whole_array_adam(params, grads, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8):
    """A step function: Adam with whole-array expressions, one temporary per operation."""
    state = [(np.zeros_like(p), np.zeros_like(p)) for p in params]
    steps = [0]

    def step() -> None:
        steps[0] += 1
        for p, g, (m, v) in zip(params, grads, state):
            m *= beta1
            m += (1.0 - beta1) * g
            v *= beta2
            v += (1.0 - beta2) * (g * g)
            m_hat = m / (1.0 - beta1 ** steps[0])
            v_hat = v / (1.0 - beta2 ** steps[0])
            p -= lr * m_hat / (v_hat ** 0.5 + eps)
    return step


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=25_000_000)
    parser.add_argument("--pieces", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
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
        "adam_whole_arrays": whole_array_adam(params, grads),
    }
    for step in steps.values():  # first touch of the state, untimed
        step()
    times: dict[str, list[float]] = {"floor": [], **{name: [] for name in steps}}
    for _ in range(args.repeats):
        times["floor"].append(timed(lambda: np.add(a, b, out=a)))
        for name, step in steps.items():
            times[name].append(timed(step))
    median = {name: statistics.median(t) for name, t in times.items()}
    fastest = {name: min(t) for name, t in times.items()}
    report = {
        "params": args.params, "pieces": args.pieces, "dtype": "float32",
        "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "add_ms": median["floor"] * 1e3,
    }
    for name in steps:
        floor = median["floor"] * ARRAYS[name] / 3
        fastest_ratio = fastest[name] / (fastest["floor"] * ARRAYS[name] / 3)
        report[name] = {"ms": median[name] * 1e3, "floor_ms": floor * 1e3,
                        "ratio": median[name] / floor, "ratio_of_fastest": fastest_ratio,
                        "target": TARGETS[name]}
        target = f"; target <= {TARGETS[name]}" if TARGETS[name] else ""
        print(f"{name:>17}: {median[name] * 1e3:7.1f} ms = {median[name] / floor:.2f} x the "
              f"floor ({floor * 1e3:.1f} ms{target}); fastest / fastest "
              f"{fastest_ratio:.2f}", flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
