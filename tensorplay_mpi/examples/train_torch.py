"""The demo job with a PyTorch model: the loop torch users write, on uneven shards.

Run (install the ``torch`` and ``examples`` extras)::

    mpiexec -n 4 python -m mpi4py -m tensorplay_mpi.examples.train_torch --epochs 30

The same data, shards, flags and output lines as :mod:`tensorplay_mpi.examples.train`, and the
same initial weights for the linear layers, but the MLP is a ``torch.nn.Sequential`` with a
``BatchNorm1d`` after its hidden layer (``--norm``: ``batch``, ``sync`` for
:class:`~tensorplay_mpi.SyncBatchNorm`, or ``none``), trained by autograd with
``torch.optim.AdamW``, a ``OneCycleLR`` schedule and ``clip_grad_norm_``: the recommended torch
loop, ``model.zero_grad()`` and ``with dp.step(): loss.backward()`` inside ``Join([dp])``
(``Join([dp, jc])`` with SyncBatchNorm, whose statistics go through ``jc``), the update (clip,
``opt.step()``, ``sched.step()``) given to ``DataParallel(..., update=...)`` so that a rank that
has run out of batches runs it too.  DataParallel binds each ``p.grad`` to its bucket, so
``backward()`` writes the gradients where the allreduce reads them, and keeps the BatchNorm
buffers identical on every rank.

``--checkpoint DIR`` stops and resumes exactly as in :mod:`tensorplay_mpi.examples.train`: a
signal stops every rank at one step, the job saves in one call the DataParallel (parameters,
buffers), the optimizer, the scheduler (torch providers: their ``state_dict()``) and the
:class:`~tensorplay_mpi.data.Sampler` (the batches, as the NumPy demo's) and exits 75; the same
command resumes and ends with the digest of a run never stopped (parameters and buffers).
``--save-every STEPS`` also saves every STEPS steps through the Join's ``on_save``, so a run
killed with SIGKILL resumes from the last one.

``--device cuda`` trains on GPUs (torch CUDA tensors; CuPy installed, the ``cuda`` extra): each
rank uses GPU ``node-local rank % GPUs visible``, so ranks share a GPU where there are fewer
GPUs than ranks.  The output is the same, the digest that of the CUDA run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from tensorplay_mpi import (DataParallel, Join, JoinableComm, checkpoint, exit_for_requeue,
                             request_save, stop_on_signals)
from tensorplay_mpi.comm import iallreduce
from tensorplay_mpi.data import Sampler
from tensorplay_mpi.examples.evaluation import validate

from .train import (STOPPED, digits, epoch_done, header, init_mlp, make_parser, parse_args, report,
                     stopped, use_gpu)

MISSING_TORCH = ("the torch demo needs PyTorch: pip install 'tensorplay-mpi[torch,examples]', "
                 "or from a clone pip install -e '.[torch,examples]'")
NO_CUDA = "--device cuda: torch sees no CUDA GPU here (torch.cuda.is_available() is False)"
LR = 0.01  # AdamW's default learning rate here (the NumPy demo's --lr is plain SGD's)
MAX_NORM = 1.0  # clip_grad_norm_'s


def make_model(n_in: int, hidden: int, n_out: int, seed: int, norm: str = "none"):
    """The demo's MLP as torch modules, with the NumPy demo's initial weights; with `norm`
    (``batch`` or ``sync``) a BatchNorm1d after the hidden layer (``sync``: converted to
    SyncBatchNorm by the caller, with its JoinableComm)."""
    import torch

    first, last = torch.nn.Linear(n_in, hidden), torch.nn.Linear(hidden, n_out)
    layers = [first] + ([torch.nn.BatchNorm1d(hidden)] if norm != "none" else [])
    model = torch.nn.Sequential(*layers, torch.nn.Tanh(), last)
    w1, b1, w2, b2 = init_mlp(n_in, hidden, n_out, seed)
    with torch.no_grad():
        for p, value in zip([*first.parameters(), *last.parameters()], (w1.T, b1, w2.T, b2)):
            p.copy_(torch.from_numpy(np.ascontiguousarray(value)))
    return model


def make_update(model: Any, lr: float, total_steps: int):
    """AdamW, OneCycleLR and clip_grad_norm_: the update ``DataParallel`` runs on every rank."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total_steps)

    def update() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        sched.step()
    return opt, sched, update


def loss_of(model: Any, x: Any, y: Any) -> tuple[Any, Any]:
    """The forward pass and the loss of one batch: (logits, loss)."""
    import torch

    logits = model(x)
    return logits, torch.nn.functional.cross_entropy(logits, y)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    parser.set_defaults(lr=LR)
    parser.add_argument("--norm", choices=["batch", "sync", "none"], default="batch",
                        help="the hidden layer's normalisation: BatchNorm1d (batch), "
                             "SyncBatchNorm through the Join's JoinableComm (sync), or none")
    args = parse_args(parser, argv)
    try:
        import torch
    except ImportError:
        raise SystemExit(MISSING_TORCH) from None
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(NO_CUDA)
    torch.set_num_threads(1)  # one core per rank, as the NumPy demo
    # from the start: a signal during the set-up rides in the first heartbeat
    with stop_on_signals() if args.checkpoint else contextlib.nullcontext():
        return run(args, MPI.COMM_WORLD)


def torch_device(comm: MPI.Intracomm, device: str) -> Any:
    """``cpu``, or this rank's GPU (``node-local rank % GPUs``), made current for torch and CuPy."""
    import torch

    if device == "cpu":
        return torch.device("cpu")
    # bitwise reproducible on the GPU (a resumed run ends with the digest of one never
    # stopped): cuBLAS's deterministic workspace, set before its first handle; an operation
    # without a deterministic kernel warns (the digest check then says whether it mattered)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    index = use_gpu(comm).cuda.Device().id  # CuPy: the library's kernels on the same GPU
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def run(args: argparse.Namespace, comm: MPI.Intracomm) -> int:
    """Train, report; the exit status (0, 1, or :data:`~tensorplay_mpi.examples.train.STOPPED`)."""
    import torch

    device = torch_device(comm, args.device)
    (x_train, y_train), (x_test, y_test) = digits(args.seed)
    sampler = Sampler(len(y_train), comm.rank, comm.size, batch_size=args.batch_size,
                      seed=args.seed, skew=args.skew)  # the NumPy demo's batches, in its order
    per_epoch = sampler.max_batches()
    model = make_model(x_train.shape[1], args.hidden, 10, args.seed, args.norm).to(device)
    joinables: list[Any] = []
    if args.norm == "sync":  # the statistics are operations of a JoinableComm in the Join
        from tensorplay_mpi import SyncBatchNorm

        joinables.append(JoinableComm(comm))
        model = SyncBatchNorm.convert_sync_batchnorm(model, joinables[0])
    opt, sched, update = make_update(model, args.lr, args.epochs * per_epoch)
    dp = DataParallel(model.parameters(), comm=comm, buffers=model.buffers(), update=update)
    header(comm, args, len(y_train), len(y_test), f"; on {dp.join_device}" if
           args.device == "cuda" else "")
    first, carried = 1, np.zeros(3)
    state = {"model": dp, "optimizer": opt, "scheduler": sched, "sampler": sampler}
    resumed = checkpoint.load(args.checkpoint, state, comm=comm) if args.checkpoint else None
    if resumed is not None:  # every object of `state` in place, the sampler at its cursor
        first = sampler.epoch
        carried = resumed.extra["totals"] if comm.rank == 0 else carried
        if comm.rank == 0:
            where = ("training was complete" if first > args.epochs else
                     f"epoch {first}, step {resumed.step} (batches done by rank: "
                     f"{list(resumed.cursors)})")
            print(f"resumed from {resumed.path}: {where}", flush=True)

    def save(totals: np.ndarray) -> checkpoint.Saved:
        """The one save: `state`, and the epoch's `totals` so far summed over the ranks."""
        return checkpoint.save(args.checkpoint, {**state, "totals": totals}, comm=comm)

    start = time.perf_counter()
    for epoch in range(first, args.epochs + 1):
        model.train()  # BatchNorm: batch statistics, running statistics updated
        sampler.set_epoch(epoch)  # a resumed epoch goes on from the cursor
        totals = carried.copy() if epoch == first else np.zeros(3)  # loss, correct, samples
        step0 = (epoch - 1) * per_epoch

        def periodic_save() -> None:  # the Join's on_save: every rank, at one iteration
            summed = np.empty(3)  # through the library's collectives (every rank is here)
            iallreduce(comm, totals, summed).wait()  # noqa: B023  (this epoch's)
            save(summed)

        with Join([dp, *joinables], divide_by_initial_world_size=args.divide == "world",
                  on_save=periodic_save if args.save_every else None) as join:
            for idx in sampler:
                if join.stopped:  # every rank leaves at this same iteration
                    break
                x = torch.from_numpy(x_train[idx]).to(device)
                y = torch.from_numpy(y_train[idx]).to(device)
                model.zero_grad()
                with dp.step():  # on exit: averaged gradients, then update() on every rank
                    logits, loss = loss_of(model, x, y)
                    loss.backward()
                totals += (loss.item() * len(idx), int((logits.argmax(1) == y).sum()), len(idx))
                if args.save_every and (step0 + sampler.cursor + 1) % args.save_every == 0:
                    request_save(f"every {args.save_every} steps")  # every active rank asks
        totals = comm.allreduce(totals)  # outside the Join: plain MPI is fine
        if join.stopped:
            stopped(comm, join.stop_reason, epoch, dp.steps, save(totals))
            return STOPPED
        model.eval()  # BatchNorm: the running statistics, no collective
        with torch.no_grad():
            validation = validate(comm, lambda x: model(torch.from_numpy(x).to(device)).cpu(),
                                  x_test, y_test, args.batch_size, args.skew, torch_metrics=True)
        epoch_done(comm, epoch, args.epochs, totals, validation)
    if args.checkpoint and first <= args.epochs:  # so that running it again only reports
        sampler.set_epoch(args.epochs + 1)
        save(np.zeros(3))
    elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)

    model.eval()
    with torch.no_grad():
        predicted = model(torch.from_numpy(x_test).to(device)).argmax(1).cpu().numpy()
    accuracy = float((predicted == y_test).mean())
    arrays = [t.detach().cpu().numpy() for t in model.state_dict().values()]  # buffers too
    return report(comm, args, arrays, accuracy, elapsed, len(y_test))


if __name__ == "__main__":
    status = main()
    if status == STOPPED:  # MPI finalized first: under python -m mpi4py a nonzero exit would
        exit_for_requeue(status)  # abort, which srun reports as "Killed" (137)
    sys.exit(status)
