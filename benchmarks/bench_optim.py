"""Optimizer step benchmark: each step's time as a ratio to the memory-traffic floor.

    OPENBLAS_NUM_THREADS=1 python benchmarks/bench_optim.py --out optim.json

The floor is the time of ``np.add(a, b, out=a)`` on the same number of float32 (3 arrays
moved), scaled to the arrays a step must move: 7 for Adam and AdamW (read p, g, m, v; write p,
m, v), 5 for SGD with momentum (read p, g, b; write p, b).  Every timing is the median over
interleaved repeats (floor, Adam, AdamW, ..., floor, ...) in one process; targets: Adam and
AdamW <= 1.3, SGD with momentum <= 1.2, and Adam within 1.3x of PyTorch's fused Adam on the
same arrays.  The ratio of the fastest repeats is reported too: on a shared machine it is the
better estimate of the uncontended cost.

- ``adam``, ``adamw``, ``sgd_momentum``: the library's optimizers as configured (the fused
  kernels when numba is installed and ``TENSORPLAY_MPI_FUSED`` is not 0);
- ``adam_numpy``, ``adamw_numpy``, ``sgd_momentum_numpy``: the same steps on the NumPy rules
  (``TENSORPLAY_MPI_FUSED=0``: the fused path forced off, as where numba has no wheels);
- ``adam_whole_arrays``: Adam written with whole-array expressions, a temporary per operation;
- ``torch_adam_fused``, ``torch_adam_foreach``: ``torch.optim.Adam(fused=True)`` and
  ``(foreach=True)`` on tensors sharing the same memory, one thread (as each rank of two on
  this machine gets) and torch's default threads (skipped, and said, without torch).

The fused kernels' compile cost (a fresh numba cache) and load cost (from the cache) are
measured in subprocesses and reported first: it is paid at optimizer construction, once per
machine when the cache is writable.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from tensorplay_mpi import SGD, Adam, AdamW
from tensorplay_mpi.settings import settings

TARGETS = {"adam": 1.3, "adamw": 1.3, "sgd_momentum": 1.2}
ARRAYS = {"sgd_momentum": 5, "sgd_momentum_numpy": 5}  # the others: 7
TORCH_TARGET = 1.3  # adam / torch_adam_fused

_WARM_UP = ("import time, numpy, numba; from tensorplay_mpi.optim import _fused as fused; "
            "t = time.process_time(); fused.warm_up([numpy.dtype('float32')]); "
            "print(time.process_time() - t)")


def kernel_costs() -> dict | None:
    """CPU seconds to compile the fused kernels for float32 (fresh cache), then to load them
    (imports excluded; CPU time, which a machine shared with other jobs inflates less)."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return None
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        runs = [float(subprocess.run([sys.executable, "-c", _WARM_UP], env=env, check=True,
                                     capture_output=True, text=True).stdout)
                for _ in range(2)]
    return {"compile_s": runs[0], "load_from_cache_s": runs[1]}


def on_numpy_rules(step):
    """`step` run with TENSORPLAY_MPI_FUSED=0."""
    def run() -> None:
        os.environ["TENSORPLAY_MPI_FUSED"] = "0"
        settings.cache_clear()
        try:
            step()
        finally:
            del os.environ["TENSORPLAY_MPI_FUSED"]
            settings.cache_clear()
    return run


def torch_steps(params, grads) -> dict:
    """PyTorch's fused and foreach Adam on tensors sharing `params` and `grads` (or nothing)."""
    try:
        import torch
    except ImportError:
        print("torch is not installed: no comparison with PyTorch's Adam", flush=True)
        return {}
    default_threads = torch.get_num_threads()
    steps = {}
    for kind in ("fused", "foreach"):
        tensors = [torch.from_numpy(p.copy()) for p in params]
        for t, g in zip(tensors, grads):
            t.grad = torch.from_numpy(g)
        adam = torch.optim.Adam(tensors, lr=1e-4, **{kind: True})
        for threads in (1, default_threads):
            def step(adam=adam, threads=threads) -> None:
                torch.set_num_threads(threads)
                adam.step()
            steps[f"torch_adam_{kind}_{threads}_thread" + "s" * (threads > 1)] = step
    return steps


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
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    sizes = [args.params // args.pieces] * args.pieces
    sizes[-1] += args.params - sum(sizes)
    params = [rng.normal(size=n).astype(np.float32) for n in sizes]
    grads = [rng.normal(scale=1e-3, size=n).astype(np.float32) for n in sizes]
    a = np.ones(args.params, np.float32)
    b = np.ones(args.params, np.float32)
    costs = kernel_costs()
    if costs is None:
        print("numba is not installed: the NumPy rules only", flush=True)
    else:
        print(f"fused kernels (float32): compile {costs['compile_s']:.2f} CPU s with a fresh "
              f"cache, load {costs['load_from_cache_s'] * 1e3:.0f} CPU ms from the cache (paid at "
              "optimizer construction, once per dtype and process)", flush=True)
    steps = {
        "adam": Adam(params, grads, lr=1e-4).step,
        "adamw": AdamW(params, grads, lr=1e-4).step,
        "sgd_momentum": SGD(params, grads, lr=1e-4, momentum=0.9).step,
        "adam_numpy": on_numpy_rules(Adam(params, grads, lr=1e-4).step),
        "adamw_numpy": on_numpy_rules(AdamW(params, grads, lr=1e-4).step),
        "sgd_momentum_numpy": on_numpy_rules(SGD(params, grads, lr=1e-4, momentum=0.9).step),
        "adam_whole_arrays": whole_array_adam(params, grads),
        **torch_steps(params, grads),
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
        "kernel_costs": costs,
    }
    for name in steps:
        arrays = ARRAYS.get(name, 7)
        floor = median["floor"] * arrays / 3
        fastest_ratio = fastest[name] / (fastest["floor"] * arrays / 3)
        report[name] = {"ms": median[name] * 1e3, "floor_ms": floor * 1e3,
                        "ratio": median[name] / floor, "ratio_of_fastest": fastest_ratio,
                        "target": TARGETS.get(name)}
        target = f"; target <= {TARGETS[name]}" if name in TARGETS else ""
        print(f"{name:>27}: {median[name] * 1e3:7.1f} ms = {median[name] / floor:.2f} x the "
              f"floor ({floor * 1e3:.1f} ms{target}); fastest / fastest "
              f"{fastest_ratio:.2f}", flush=True)
    for name in [n for n in steps if n.startswith("torch_")]:
        ratio, fastest_ratio = median["adam"] / median[name], fastest["adam"] / fastest[name]
        report[f"adam_vs_{name}"] = {"ratio": ratio, "ratio_of_fastest": fastest_ratio,
                                     "target": TORCH_TARGET if "fused" in name else None}
        target = f"; target <= {TORCH_TARGET}" if "fused" in name else ""
        print(f"adam / {name}: {ratio:.2f}{target}; fastest / fastest {fastest_ratio:.2f}",
              flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
