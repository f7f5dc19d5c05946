"""Data-parallel training of an MLP on uneven shards: the demo job.

Run (``make demo`` does this at 4 ranks)::

    mpiexec -n 4 python -m mpi4py -m tensorplay_mpi.examples.train --epochs 30
    srun --mpi=pmi2 python -m mpi4py -m tensorplay_mpi.examples.train --device cuda   # on GPUs

A NumPy MLP classifies the scikit-learn digits (bundled with scikit-learn, no download; install
the ``examples`` extra).  The training set is split unevenly: rank ``r`` holds a share
proportional to ``1 + skew * r``, nothing padded, nothing dropped, so every sample is used
exactly once per epoch and ranks run different numbers of batches.  ``DataParallel`` averages
the gradients (overlapping the reduction with the backward pass through ``mark_ready``) inside
a ``Join``, which lets ranks that run out of batches shadow the others.  With ``--device cuda``
the model and the batches live on a GPU (CuPy, the ``cuda`` extra), each rank taking GPU
``node-local rank % GPUs visible``.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from types import ModuleType
from typing import Any

import numpy as np
from mpi4py import MPI

from tensorplay_mpi import DataParallel, Join
from tensorplay_mpi.data import batches, shard, shard_sizes


MISSING_SKLEARN = ("the demo needs scikit-learn for its data set (the digits, bundled with it): "
                   "pip install 'tensorplay-mpi[examples]', or from a clone "
                   "pip install -e '.[examples]'")
MISSING_CUPY = ("--device cuda needs CuPy: pip install 'tensorplay-mpi[cuda]' (or the cupy-cudaXXx "
                "wheel of your CUDA version)")


def load_digits_split(seed: int, test_fraction: float = 0.2):
    """Digits as float32 in [0, 1], split into a training and a held-out set."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = (x[order] / 16.0).astype(np.float32), y[order]
    n_test = int(len(y) * test_fraction)
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def init_mlp(n_in: int, hidden: int, n_out: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(n_in, hidden)) / np.sqrt(n_in)).astype(np.float32),
        np.zeros(hidden, np.float32),
        (rng.normal(size=(hidden, n_out)) / np.sqrt(hidden)).astype(np.float32),
        np.zeros(n_out, np.float32),
    ]


def use_gpu(comm: MPI.Intracomm) -> ModuleType:
    """Import CuPy and use GPU ``node-local rank % GPUs visible``; return the cupy module."""
    try:
        import cupy
    except ImportError:
        raise SystemExit(MISSING_CUPY) from None
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)  # the ranks on this node; before any Join
    local_rank = node.Get_rank()
    node.Free()
    cupy.cuda.Device(local_rank % cupy.cuda.runtime.getDeviceCount()).use()
    return cupy


def array_module(x: Any) -> ModuleType:
    """CuPy for CuPy arrays, else NumPy."""
    cupy = sys.modules.get("cupy")
    return cupy if cupy is not None and isinstance(x, cupy.ndarray) else np


def forward(params: list[Any], x: Any) -> tuple[Any, Any]:
    """Hidden activations and class probabilities (NumPy or CuPy arrays)."""
    xp = array_module(x)
    w1, b1, w2, b2 = params
    hidden = xp.tanh(x @ w1 + b1)
    logits = hidden @ w2 + b2
    logits -= logits.max(axis=1, keepdims=True)
    probs = xp.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    return hidden, probs


def backward(params, x, y, dp: DataParallel) -> tuple[float, int]:
    """Write the batch-mean cross-entropy gradients into ``dp.grads``, last layer first,
    marking each one ready so its bucket can start reducing; return (loss sum, correct)."""
    xp = array_module(x)
    w1, b1, w2, b2 = params
    hidden, probs = forward(params, x)
    rows = xp.arange(len(y))
    loss = -xp.log(probs[rows, y] + 1e-12).sum()
    correct = int((probs.argmax(axis=1) == y).sum())
    dlogits = probs
    dlogits[rows, y] -= 1.0
    dlogits /= len(y)
    xp.sum(dlogits, axis=0, out=dp.grads[3])
    dp.mark_ready(3)
    xp.matmul(hidden.T, dlogits, out=dp.grads[2])
    dp.mark_ready(2)
    dhidden = (dlogits @ w2.T) * (1.0 - hidden * hidden)
    xp.sum(dhidden, axis=0, out=dp.grads[1])
    dp.mark_ready(1)
    xp.matmul(x.T, dhidden, out=dp.grads[0])
    dp.mark_ready(0)
    return float(loss), correct


def progress(epoch: int, epochs: int, text: str, width: int = 30) -> None:
    done = int(width * epoch / epochs)
    bar = f"[{'#' * done}{'.' * (width - done)}] epoch {epoch:>3}/{epochs}  {text}"
    end = "\n" if epoch == epochs or not sys.stdout.isatty() else ""
    print(("\r" if sys.stdout.isatty() else "") + bar, end=end, flush=True)


def params_digest(params: list[Any]) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for p in params:
        digest.update((p if isinstance(p, np.ndarray) else p.get()).tobytes())
    return digest.hexdigest()


def header(comm: MPI.Intracomm, args: argparse.Namespace, trained: int, tested: int,
           note: str = "") -> None:
    """The demo's first line, on rank 0."""
    if comm.rank == 0:
        sizes = shard_sizes(trained, comm.size, args.skew)
        print(f"{comm.size} ranks, {trained} training samples split {sizes}, "
              f"{tested} held out; averaging over the {args.divide} size{note}", flush=True)


def epoch_done(comm: MPI.Intracomm, epoch: int, epochs: int, totals: np.ndarray) -> None:
    """The progress line of an epoch from every rank's (loss sum, correct, samples).

    Collective over `comm`, outside the Join: plain MPI is fine there."""
    loss, correct, samples = comm.allreduce(totals)
    if comm.rank == 0:
        progress(epoch, epochs, f"loss {loss / samples:.4f}  "
                                f"train accuracy {correct / samples:.4f}")


def make_parser() -> argparse.ArgumentParser:
    """The demo's flags (``examples.train_torch`` takes the same)."""
    parser = argparse.ArgumentParser(description="Data-parallel MLP on uneven shards.")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skew", type=float, default=1.0,
                        help="rank r holds a share proportional to 1 + skew * r (0: even)")
    parser.add_argument("--divide", choices=["world", "active"], default="world",
                        help="average over the world size or over the active ranks")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--min-accuracy", type=float, default=0.95,
                        help="exit 1 when the held-out accuracy is lower")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: CuPy arrays on GPU (node-local rank %% GPUs visible)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)

    comm = MPI.COMM_WORLD
    try:
        (x_train, y_train), (x_test, y_test) = load_digits_split(args.seed)
    except ImportError:
        raise SystemExit(MISSING_SKLEARN) from None
    xp = use_gpu(comm) if args.device == "cuda" else np
    mine = shard(len(y_train), comm.rank, comm.size, args.skew)
    params = [xp.asarray(p) for p in init_mlp(x_train.shape[1], args.hidden, 10, args.seed)]
    dp = DataParallel(params, comm=comm)
    header(comm, args, len(y_train), len(y_test),
           f"; on {dp.join_device}" if args.device == "cuda" else "")

    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        rng = np.random.default_rng([args.seed, epoch, comm.rank])
        totals = np.zeros(3)  # loss sum, correct, samples
        with Join([dp], divide_by_initial_world_size=args.divide == "world"):
            for idx in batches(mine, args.batch_size, rng):
                with dp.step():
                    x, y = xp.asarray(x_train[idx]), xp.asarray(y_train[idx])
                    loss, correct = backward(params, x, y, dp)
                for p, g in zip(params, dp.grads):
                    p -= args.lr * g
                totals += (loss, correct, len(idx))
        epoch_done(comm, epoch, args.epochs, totals)
    elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)

    predicted = forward(params, xp.asarray(x_test))[1].argmax(axis=1)
    accuracy = float((predicted == xp.asarray(y_test)).mean())
    return report(comm, args, params, accuracy, elapsed, len(y_test))


def report(comm: MPI.Intracomm, args: argparse.Namespace, params: list[Any], accuracy: float,
           elapsed: float, tested: int) -> int:
    """Print the demo's last lines on rank 0; the exit status: 0 if accurate and identical.

    Collective over `comm` (it compares the parameters' digests)."""
    digests = comm.allgather(params_digest(params))
    identical = len(set(digests)) == 1
    if comm.rank == 0:
        print(f"held-out accuracy {accuracy:.4f} ({tested} samples)")
        print(f"training time {elapsed:.2f} s for {args.epochs} epochs on {comm.size} ranks")
        print(f"parameters identical on all {comm.size} ranks: {'yes' if identical else 'NO'} "
              f"(digest {digests[0]})")
        if accuracy < args.min_accuracy:
            print(f"FAILED: held-out accuracy {accuracy:.4f} is below --min-accuracy "
                  f"{args.min_accuracy}: train longer (--epochs, default 30) or lower "
                  "--min-accuracy; exiting with status 1")
        if not identical:
            print("FAILED: the parameters differ between ranks; exiting with status 1")
    sys.stdout.flush()  # an exit status 1 under python -m mpi4py aborts before Python flushes
    return 0 if identical and accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
