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
only prints the result.  With ``--save-every STEPS`` it also writes the checkpoint every STEPS
steps, inside the Join (joined ranks included), so a job killed without a signal (``kill -9``,
a node failure, an OOM kill) resumes from the last of these saves.

With ``--elastic`` (Open MPI 5 under ``mpiexec --with-ft ulfm``) a rank that dies does not end
the job: the survivors shrink the communicator, settle the interrupted step, re-split the
epoch's unused samples and go on; the run ends with exit status 0 on the survivors.  Without
fault tolerance ``--elastic`` changes nothing: a lost rank ends the job.  With ``--spares K``
too, the last K processes are hot spares (:class:`~tensorplay_mpi.algorithms.SparePool`): they
wait asleep, and one takes a lost rank's place, so the run goes on at its original width.
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

from tensorplay_mpi import (SGD, DataParallel, Join, RanksLostError, checkpoint,
                            exit_for_requeue, keep_stop_signals, request_save)
from tensorplay_mpi.algorithms import SparePool, recover
from tensorplay_mpi.comm import iallgather, iallreduce, is_process_failure
from tensorplay_mpi.data import Sampler, shard_sizes
from tensorplay_mpi.examples.evaluation import validate
from tensorplay_mpi.stopping import REQUEUE_STATUS

STOPPED = REQUEUE_STATUS  # 75
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


def node_local_rank(comm: MPI.Intracomm) -> tuple[int, int]:
    """This rank's place among the ranks of `comm` on its node, and their number.

    Collective (a blocking ``Split_type``): call it before any Join."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def use_gpu(comm: MPI.Intracomm) -> ModuleType:
    """Import CuPy and use GPU ``node-local rank % GPUs visible``; return the cupy module."""
    try:
        import cupy
    except ImportError:
        raise SystemExit(MISSING_CUPY) from None
    local_rank, _ = node_local_rank(comm)
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


def epoch_bar(epoch: int, epochs: int, text: str, width: int = 30) -> None:
    """Print a bar of the epochs done and `text` (in place on a terminal)."""
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
    """The line of an epoch, on rank 0, from the (loss sum, correct, samples) summed
    over ranks, and the `validation` line of examples.evaluation."""
    loss, correct, samples = totals
    if comm.rank == 0:
        epoch_bar(epoch, epochs, f"loss {loss / samples:.4f}  train accuracy "
                                 f"{correct / samples:.4f}  {validation}")


class Tally:
    """An epoch's running totals on this rank: loss sum, correct, samples, and how many times
    each sample was used (to check every sample once per epoch across resumes)."""

    def __init__(self, num_samples: int, saved: dict[str, np.ndarray] | None = None) -> None:
        saved = saved or {}
        self.totals = np.array(saved.get("totals", np.zeros(3)), dtype=np.float64)
        self.seen = np.array(saved.get("seen", np.zeros(num_samples, np.uint8)), dtype=np.uint8)

    def add(self, idx: np.ndarray, loss: float, correct: int) -> None:
        self.totals += (loss, correct, len(idx))
        np.add.at(self.seen, idx, 1)

    def summed(self, comm: MPI.Intracomm) -> dict[str, np.ndarray]:
        """Every rank's tally summed, on every rank; through the library's collectives, so a
        Join's ``on_save`` may call it (every rank, joined or not, runs it at one point)."""
        out: dict[str, np.ndarray] = {"totals": np.empty(3), "seen": np.empty_like(self.seen)}
        for name, mine in (("totals", self.totals), ("seen", self.seen)):
            iallreduce(comm, mine, out[name]).wait()
        return out


def once(comm: MPI.Intracomm, epoch: int, seen: np.ndarray, how: str = "resumed") -> bool:
    """Print (rank 0) how many samples `epoch` used and whether each exactly once."""
    ok = bool((seen == 1).all())
    if comm.rank == 0:
        verdict = "yes" if ok else (f"NO ({int((seen == 0).sum())} never, "
                                    f"{int((seen > 1).sum())} more than once)")
        print(f"epoch {epoch} ({how}) used {int(seen.sum())} samples of {seen.size}, each "
              f"exactly once: {verdict}", flush=True)
    return ok


class Survivors:
    """The demo's side of ``--elastic``: after a lost rank, the survivors' communicator, the
    sampler re-split and the epoch's tally completed."""

    def __init__(self, comm: MPI.Intracomm, elastic: bool, pool: SparePool) -> None:
        self.comm, self.elastic, self.lost_in_epoch = comm, elastic, False
        self.pool = pool  # --spares: a spare takes a lost rank's place
        self.deferred: RanksLostError | None = None  # a loss between Joins, refilled later

    def lost(self, lost: RanksLostError, sampler: Sampler, tally: "Tally", split_start: int,
             pending: np.ndarray | None, epoch: int, joinables: list[Any],
             between_joins: bool = False) -> None:
        """Go on after `lost`: the sampler re-split from the split's steps (`split_start`: the
        step where the split began), the lost ranks' and the completed pending samples
        tallied; with spares, one brought in for each lost rank while any is left: at once
        for a loss in the epoch's training Join (a recruit enters the loop there), at the
        next epoch's start for one `between_joins` (:meth:`refill_deferred`)."""
        self.lost_in_epoch = True
        gone = sampler.shrink(lost.lost, max(0, lost.step - split_start))
        if lost.completed and pending is not None:  # its step was applied by another rank
            np.add.at(tally.seen, pending, 1)
        if lost.rank == 0:
            np.add.at(tally.seen, gone, 1)
        if between_joins:
            self.comm, self.deferred = lost.comm, lost
        else:
            self.comm = self.pool.refill(lost, joinables, sampler)
        if lost.rank == 0:
            came = self.comm.Get_size() - lost.size
            spares = f" ({came} spare(s) in their place)" if came else ""
            print(f"lost rank(s) {lost.lost} of {lost.old_size} at epoch {epoch}, step "
                  f"{lost.step}; going on with {self.comm.Get_size()} ranks{spares}",
                  flush=True)

    def refill_deferred(self, joinables: list[Any], sampler: Sampler) -> None:
        """Spares in the places of ranks lost between the last epoch's Joins (validation, the
        tally): at this epoch's start, where a recruit's loop begins (its sampler's epoch)."""
        if self.deferred is not None:
            lost, self.deferred = self.deferred, None
            self.comm = self.pool.refill(lost, joinables, sampler)

    def retry(self, what: Any, joinables: list[Any], on_lost: Any) -> Any:
        """``what()``, again after a lost rank surfacing outside a Join (``on_lost(lost)``
        first), under ``--elastic``."""
        while True:
            try:
                return what()
            except MPI.Exception as error:
                if not (self.elastic and is_process_failure(error, self.comm)):
                    raise
                lost = recover(self.comm, joinables, error)
                self.comm = lost.comm
                on_lost(lost)


def stopped(comm: MPI.Intracomm, reason: str | None, epoch: int, step: int,
            saved: checkpoint.Saved) -> None:
    """The line (rank 0) of a stopped run: why, where, and the checkpoint written."""
    if comm.rank == 0:
        print(f"stopped by {reason} at epoch {epoch}, step {step}; checkpoint {saved.path} "
              f"written ({saved.nbytes / 1024:.0f} KiB in {saved.seconds * 1e3:.1f} ms); run "
              f"the same command to resume", flush=True)


def make_parser() -> argparse.ArgumentParser:
    """The demo's flags (``examples.train_torch`` takes the same, but ``--checkpoint``)."""
    parser = argparse.ArgumentParser(description="Data-parallel MLP on uneven shards.")
    for flag, kind, default in (("--epochs", int, 30), ("--seed", int, 0),
                                ("--batch-size", int, 16), ("--lr", float, 0.2),
                                ("--hidden", int, 64)):
        parser.add_argument(flag, type=kind, default=default)
    parser.add_argument("--skew", type=float, default=1.0,
                        help="rank r holds a share proportional to 1 + skew * r (0: even)")
    parser.add_argument("--divide", choices=["world", "active"], default="world",
                        help="average over the world size or over the active ranks")
    parser.add_argument("--min-accuracy", type=float, default=0.95,
                        help="exit 1 when the held-out accuracy is lower")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: CuPy arrays on GPU (node-local rank %% GPUs visible)")
    parser.add_argument("--checkpoint", metavar="DIR",
                        help="resume from the checkpoint in DIR if there is one; on SIGTERM, "
                             f"SIGUSR1 or SIGINT stop, write it and exit with status {STOPPED}")
    parser.add_argument("--save-every", type=int, default=0, metavar="STEPS",
                        help="with --checkpoint: also write it every STEPS steps (0: never)")
    parser.add_argument("--elastic", action="store_true",
                        help="go on without a rank that dies (Open MPI under mpiexec "
                             "--with-ft ulfm; elsewhere a lost rank ends the job)")
    parser.add_argument("--spares", type=int, default=0, metavar="K",
                        help="with --elastic: the last K processes wait as hot spares, and "
                             "one takes a lost rank's place (the width is kept)")
    return parser


RESUMABLE = ("epochs", "checkpoint", "save_every", "min_accuracy", "elastic")
"""The flags a resume may change; the checkpoint records every other one (``config=``)."""


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The flags the saved state and the cursors depend on (batch size, seed, model, ...)."""
    return {k: v for k, v in vars(args).items() if k not in RESUMABLE}


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The demo's flags from `argv`, checked (``examples.train_torch`` adds its own first)."""
    args = parser.parse_args(argv)
    if args.save_every < 0 or (args.save_every and not args.checkpoint):
        parser.error("--save-every takes a number of steps >= 0 and needs --checkpoint")
    if args.spares < 0 or (args.spares and (not args.elastic or args.checkpoint)):
        parser.error("--spares takes a number >= 0 and needs --elastic (not --checkpoint: a "
                     "spare does not resume from a checkpoint yet)")
    return args


def digits(seed: int) -> tuple:
    """:func:`load_digits_split`, or exit saying that scikit-learn is missing."""
    try:
        return load_digits_split(seed)
    except ImportError:
        raise SystemExit(MISSING_SKLEARN) from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(make_parser(), argv)
    if args.checkpoint:  # until the end: a signal during the set-up rides in the first
        keep_stop_signals()  # heartbeat; one during the final save or report is harmless
    return run(args, MPI.COMM_WORLD)


def run(args: argparse.Namespace, comm: MPI.Intracomm) -> int:
    """Train, report; the exit status (0, 1, or :data:`STOPPED`)."""
    (x_train, y_train), (x_test, y_test) = digits(args.seed)
    pool = SparePool(comm, getattr(args, "spares", 0))
    comm = pool.comm  # the trainers' (a spare's own, until it is recruited)
    xp = use_gpu(comm) if args.device == "cuda" else np
    sampler = Sampler(len(y_train), comm.rank, comm.size, batch_size=args.batch_size,
                      seed=args.seed, skew=args.skew)  # the order: f(seed, epoch, rank)
    params = [xp.asarray(p) for p in init_mlp(x_train.shape[1], args.hidden, 10, args.seed)]
    dp = DataParallel(params, comm=comm)
    # in the Join, so that a joined rank steps too: every rank's parameters are current at a
    # periodic save (an update written after dp.step() in the loop would skip joined ranks)
    opt = SGD(params, dp.grads, lr=args.lr)
    recruited = pool.spare
    if recruited and not pool.wait([dp, opt], sampler):
        return 0  # the job ended without needing this spare
    comm = pool.comm
    if not recruited:
        header(comm, args, len(y_train), len(y_test),
               f"; on {dp.join_device}" if args.device == "cuda" else "")
    first, tally = 1, Tally(len(y_train))
    config = run_config(args)
    state = {"model": dp, "optimizer": opt, "sampler": sampler}  # what a checkpoint holds

    def save(comm: MPI.Intracomm, totals: dict[str, np.ndarray]) -> checkpoint.Saved:
        """The demo's one save (a stop's, a periodic one, the last): `state`, and the epoch's
        `totals` so far summed over the ranks."""
        return checkpoint.save(args.checkpoint, {**state, **totals}, comm=comm, config=config)

    resumed = (checkpoint.load(args.checkpoint, state, comm=comm, config=config, resize=True)
               if args.checkpoint else None)  # the sampler resumes: its epoch and cursors
    if resumed is not None:
        first = sampler.epoch
        if comm.rank == 0:  # the epoch's totals so far, summed over the ranks that saved
            tally = Tally(len(y_train), resumed.extra)
            where = ("training was complete" if first > args.epochs else
                     f"epoch {first}, step {resumed.step} (batches done by rank: "
                     f"{list(resumed.cursors)})")
            size = ("" if resumed.world_size == comm.size else
                    f"; saved at {resumed.world_size} ranks, the rest of the epoch re-split")
            print(f"resumed from {resumed.path}: {where}{size}", flush=True)

    survivors = Survivors(comm, args.elastic, pool)
    start = time.perf_counter()
    if recruited:  # a spare in a lost rank's place: from the trainers' epoch on
        first = sampler.epoch
        print(f"rank {comm.rank}: a spare, brought in at epoch {first}, step {opt.steps}",
              flush=True)
    for epoch in range(first, args.epochs + 1):
        sampler.set_epoch(epoch)  # a resumed epoch goes on from the cursors
        survivors.refill_deferred([dp, opt], sampler)
        comm = survivors.comm
        tally = tally if epoch == first else Tally(len(y_train))
        step0 = (epoch - 1) * sampler.max_batches()  # steps before this epoch (approximately,
        # after a resize: it only spaces the periodic saves)
        survivors.lost_in_epoch = recruited and epoch == first

        def periodic_save() -> None:  # the Join's on_save: every rank, at one iteration
            save(survivors.comm, tally.summed(survivors.comm))  # noqa: B023  (this epoch's)

        while True:  # once, or again on the survivors after a lost rank (--elastic)
            split_start, pending = opt.steps, None
            try:
                with Join([dp, opt], divide_by_initial_world_size=args.divide == "world",
                          on_save=periodic_save if args.save_every else None,
                          elastic=args.elastic) as join:
                    for idx in sampler:
                        if join.stopped:  # every rank leaves at this same iteration
                            break
                        pending = idx
                        with dp.step():
                            x, y = xp.asarray(x_train[idx]), xp.asarray(y_train[idx])
                            loss, correct = backward(params, x, y, dp)
                        opt.step()
                        tally.add(idx, loss, correct)
                        pending = None
                        if args.save_every and (step0 + sampler.cursor + 1) % args.save_every == 0:
                            request_save(f"every {args.save_every} steps")  # every active rank
                break
            except RanksLostError as lost:
                survivors.lost(lost, sampler, tally, split_start, pending, epoch, [dp, opt])
                comm = survivors.comm

        def after_join(lost: RanksLostError, split_start: int = split_start,
                       epoch: int = epoch) -> None:  # a loss between the epoch's Joins
            survivors.lost(lost, sampler, tally, split_start, None, epoch,  # noqa: B023
                           [dp, opt], between_joins=True)

        validation = "" if join.stopped else survivors.retry(lambda: validate(
            survivors.comm, lambda batch: forward(params, xp.asarray(batch))[1], x_test, y_test,
            args.batch_size, args.skew), [dp, opt], after_join)  # before the tally: a loss
        summed = survivors.retry(lambda: tally.summed(survivors.comm),  # noqa: B023
                                 [dp, opt], after_join)  # here adds the lost rank's samples
        comm = survivors.comm
        totals = summed["totals"]
        if join.stopped:
            stopped(comm, join.stop_reason, epoch, dp.steps, save(comm, summed))
            return STOPPED
        if resumed is not None and epoch == first and not once(comm, epoch, summed["seen"]):
            return 1
        if survivors.lost_in_epoch and not once(comm, epoch, summed["seen"],
                                                "with a lost rank"):
            return 1
        epoch_done(comm, epoch, args.epochs, totals, validation)
    if args.checkpoint and first <= args.epochs:  # so that running it again only reports
        sampler.set_epoch(args.epochs + 1)
        save(comm, {})
    hits = forward(params, xp.asarray(x_test))[1].argmax(axis=1) == xp.asarray(y_test)

    def finish() -> int:
        elapsed = np.array([time.perf_counter() - start])
        iallreduce(survivors.comm, MPI.IN_PLACE, elapsed, MPI.MAX, "the time").wait()
        return report(survivors.comm, args, params, float(hits.mean()), float(elapsed[0]),
                      len(y_test))

    status = survivors.retry(finish, [dp, opt], lambda lost: None)
    pool.close()  # the spares left waiting exit
    return status


def report(comm: MPI.Intracomm, args: argparse.Namespace, params: list[Any], accuracy: float,
           elapsed: float, tested: int) -> int:
    """Print the demo's last lines on rank 0; the exit status: 0 if accurate and identical.

    Collective over `comm` (it compares the parameters' digests, through the library: a rank
    lost meanwhile is an error, never a garbled result)."""
    mine = np.frombuffer(bytes.fromhex(params_digest(params)), np.int64)
    every = np.empty(comm.size, np.int64)
    iallgather(comm, mine, every, "the parameters' digests").wait()
    digests = [int(d).to_bytes(8, "little", signed=True).hex() for d in every]
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
    if status == STOPPED:  # MPI finalized first: under python -m mpi4py a nonzero exit would
        exit_for_requeue(status)  # abort, which srun reports as "Killed" (137)
    sys.exit(status)
