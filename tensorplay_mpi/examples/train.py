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

With ``--checkpoint DIR`` the job can be stopped and resumed: SIGTERM, SIGUSR1 or SIGINT on any
rank (as ``srun``, ``scancel`` and Slurm's time limit deliver them) stops every rank at one
iteration boundary; the job writes a checkpoint to DIR and exits with status 75 (EX_TEMPFAIL:
stopped, run it again).  The same command then resumes where it stopped and ends with the
digest of a run never stopped.  A completed run also leaves a checkpoint, so running it again
only prints the result.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import sys
import time
from types import ModuleType
from typing import Any

import numpy as np
from mpi4py import MPI

from tensorplay_mpi import DataParallel, Join, checkpoint, stop_on_signals
from tensorplay_mpi.data import batches, shard, shard_sizes
from tensorplay_mpi.examples.evaluation import validate

STOPPED = 75
"""The exit status of a stopped job (EX_TEMPFAIL of sysexits.h): its checkpoint is written,
running the same command resumes it."""


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


def epoch_done(comm: MPI.Intracomm, epoch: int, epochs: int, totals: np.ndarray,
               validation: str = "") -> None:
    """The progress line of an epoch, on rank 0, from the (loss sum, correct, samples) summed
    over ranks, and the `validation` line of examples.evaluation."""
    loss, correct, samples = totals
    if comm.rank == 0:
        progress(epoch, epochs,
                 f"loss {loss / samples:.4f}  train accuracy {correct / samples:.4f}  {validation}")


def make_parser() -> argparse.ArgumentParser:
    """The demo's flags (``examples.train_torch`` takes the same, but ``--checkpoint``)."""
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
    parser.add_argument("--checkpoint", metavar="DIR",
                        help="resume from the checkpoint in DIR if there is one; on SIGTERM, "
                             f"SIGUSR1 or SIGINT stop, write it and exit with status {STOPPED}")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    # from the start: a signal during the set-up rides in the first heartbeat
    with stop_on_signals() if args.checkpoint else contextlib.nullcontext():
        return run(args, MPI.COMM_WORLD)


def run(args: argparse.Namespace, comm: MPI.Intracomm) -> int:
    """Train, report; the exit status (0, 1, or :data:`STOPPED`)."""
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
    sizes = shard_sizes(len(y_train), comm.size, args.skew)
    per_epoch = math.ceil(max(sizes) / args.batch_size)  # iterations: the longest shard's
    first, skip, carried = 1, 0, np.zeros(3)
    resumed = checkpoint.load(args.checkpoint, params, comm=comm) if args.checkpoint else None
    if resumed is not None:
        first, skip = resumed.epoch, resumed.cursor
        carried = resumed.extra["totals"] if comm.rank == 0 else carried
        if comm.rank == 0:
            where = ("training was complete" if first > args.epochs else
                     f"epoch {first}, step {resumed.step} (batches done by rank: "
                     f"{list(resumed.cursors)})")
            print(f"resumed from {resumed.path}: {where}", flush=True)

    start = time.perf_counter()
    for epoch in range(first, args.epochs + 1):
        rng = np.random.default_rng([args.seed, epoch, comm.rank])  # order: f(seed, epoch)
        done = skip if epoch == first else 0  # batches of this epoch consumed: the cursor
        totals = carried.copy() if epoch == first else np.zeros(3)  # loss, correct, samples
        with Join([dp], divide_by_initial_world_size=args.divide == "world") as join:
            for idx in batches(mine, args.batch_size, rng)[done:]:
                if join.stopped:  # every rank leaves at this same iteration
                    break
                with dp.step():
                    x, y = xp.asarray(x_train[idx]), xp.asarray(y_train[idx])
                    loss, correct = backward(params, x, y, dp)
                for p, g in zip(params, dp.grads):
                    p -= args.lr * g
                totals += (loss, correct, len(idx))
                done += 1
        totals = comm.allreduce(totals)  # outside the Join: plain MPI is fine
        if join.stopped:
            step = (epoch - 1) * per_epoch + comm.allreduce(done, op=MPI.MAX)
            saved = checkpoint.save(args.checkpoint, params, step=step, epoch=epoch,
                                    cursor=done, extra={"totals": totals}, comm=comm)
            if comm.rank == 0:
                print(f"stopped by {join.stop_reason} at epoch {epoch}, step {step}; checkpoint "
                      f"{saved.path} written ({saved.nbytes / 1024:.0f} KiB in "
                      f"{saved.seconds * 1e3:.1f} ms); run the same command to resume",
                      flush=True)
            return STOPPED
        epoch_done(comm, epoch, args.epochs, totals, validate(
            comm, lambda x: forward(params, xp.asarray(x))[1], x_test, y_test, args.batch_size,
            args.skew))
    if args.checkpoint and first <= args.epochs:  # so that running it again only reports
        checkpoint.save(args.checkpoint, params, step=args.epochs * per_epoch,
                        epoch=args.epochs + 1, extra={"totals": np.zeros(3)}, comm=comm)
    elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
    hits = forward(params, xp.asarray(x_test))[1].argmax(axis=1) == xp.asarray(y_test)
    return report(comm, args, params, float(hits.mean()), elapsed, len(y_test))


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
    status = main()
    if status == STOPPED:  # exit with it: under python -m mpi4py a nonzero exit would abort,
        MPI.Finalize()     # which srun reports as "Killed" (137)
    sys.exit(status)
