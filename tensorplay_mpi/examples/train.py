"""Data-parallel training of an MLP on uneven shards: the demo job.

Run (``make demo`` does this at 4 ranks)::

    mpiexec -n 4 python -m mpi4py -m tensorplay_mpi.examples.train --epochs 30

A NumPy MLP classifies the scikit-learn digits (bundled with scikit-learn, no download; install
the ``examples`` extra).  The training set is split unevenly: rank ``r`` holds a share
proportional to ``1 + skew * r``, nothing padded, nothing dropped, so every sample is used
exactly once per epoch and ranks run different numbers of batches.  ``DataParallel`` averages
the gradients (overlapping the reduction with the backward pass through ``mark_ready``) inside
a ``Join``, which lets ranks that run out of batches shadow the others.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

import numpy as np
from mpi4py import MPI

from tensorplay_mpi import DataParallel, Join
from tensorplay_mpi.data import batches, shard, shard_sizes


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


def forward(params: list[np.ndarray], x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hidden activations and class probabilities."""
    w1, b1, w2, b2 = params
    hidden = np.tanh(x @ w1 + b1)
    logits = hidden @ w2 + b2
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    return hidden, probs


def backward(params, x, y, dp: DataParallel) -> tuple[float, int]:
    """Write the batch-mean cross-entropy gradients into ``dp.grads``, last layer first,
    marking each one ready so its bucket can start reducing; return (loss sum, correct)."""
    w1, b1, w2, b2 = params
    hidden, probs = forward(params, x)
    loss = -np.log(probs[np.arange(len(y)), y] + 1e-12).sum()
    correct = int((probs.argmax(axis=1) == y).sum())
    dlogits = probs
    dlogits[np.arange(len(y)), y] -= 1.0
    dlogits /= len(y)
    np.sum(dlogits, axis=0, out=dp.grads[3])
    dp.mark_ready(3)
    np.matmul(hidden.T, dlogits, out=dp.grads[2])
    dp.mark_ready(2)
    dhidden = (dlogits @ w2.T) * (1.0 - hidden * hidden)
    np.sum(dhidden, axis=0, out=dp.grads[1])
    dp.mark_ready(1)
    np.matmul(x.T, dhidden, out=dp.grads[0])
    dp.mark_ready(0)
    return float(loss), correct


def progress(epoch: int, epochs: int, text: str, width: int = 30) -> None:
    done = int(width * epoch / epochs)
    bar = f"[{'#' * done}{'.' * (width - done)}] epoch {epoch:>3}/{epochs}  {text}"
    end = "\n" if epoch == epochs or not sys.stdout.isatty() else ""
    print(("\r" if sys.stdout.isatty() else "") + bar, end=end, flush=True)


def params_digest(params: list[np.ndarray]) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for p in params:
        digest.update(p.tobytes())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
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
    args = parser.parse_args(argv)

    comm = MPI.COMM_WORLD
    (x_train, y_train), (x_test, y_test) = load_digits_split(args.seed)
    mine = shard(len(y_train), comm.rank, comm.size, args.skew)
    params = init_mlp(x_train.shape[1], args.hidden, 10, args.seed)
    dp = DataParallel(params, comm=comm)
    if comm.rank == 0:
        sizes = shard_sizes(len(y_train), comm.size, args.skew)
        print(f"{comm.size} ranks, {len(y_train)} training samples split {sizes}, "
              f"{len(y_test)} held out; averaging over the {args.divide} size")

    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        rng = np.random.default_rng([args.seed, epoch, comm.rank])
        totals = np.zeros(3)  # loss sum, correct, samples
        with Join([dp], divide_by_initial_world_size=args.divide == "world"):
            for idx in batches(mine, args.batch_size, rng):
                with dp.step():
                    loss, correct = backward(params, x_train[idx], y_train[idx], dp)
                for p, g in zip(params, dp.grads):
                    p -= args.lr * g
                totals += (loss, correct, len(idx))
        loss, correct, samples = comm.allreduce(totals)  # outside the Join: plain MPI is fine
        if comm.rank == 0:
            progress(epoch, args.epochs, f"loss {loss / samples:.4f}  "
                                         f"train accuracy {correct / samples:.4f}")
    elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)

    accuracy = float((forward(params, x_test)[1].argmax(axis=1) == y_test).mean())
    digests = comm.allgather(params_digest(params))
    identical = len(set(digests)) == 1
    if comm.rank == 0:
        print(f"held-out accuracy {accuracy:.4f} ({len(y_test)} samples)")
        print(f"training time {elapsed:.2f} s for {args.epochs} epochs on {comm.size} ranks")
        print(f"parameters identical on all {comm.size} ranks: {'yes' if identical else 'NO'} "
              f"(digest {digests[0]})")
    return 0 if identical and accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
