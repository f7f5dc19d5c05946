"""The demo job with a PyTorch model: the loop torch users write, on uneven shards.

Run (install the ``torch`` and ``examples`` extras)::

    mpiexec -n 4 python -m mpi4py -m tensorplay_mpi.examples.train_torch --epochs 30

The same data, shards, flags and output lines as :mod:`tensorplay_mpi.examples.train`, and the
same initial weights, but the MLP is a ``torch.nn.Sequential`` trained by autograd:
``model.zero_grad()``, ``with dp.step(): loss.backward()``, ``opt.step()`` inside
``Join([dp, opt])``.  DataParallel binds each ``p.grad`` to its bucket, so ``backward()``
writes the gradients where the allreduce reads them, and each parameter's post-accumulate-grad
hook starts its bucket during the backward pass.  CPU only (``--device cuda`` exits with a
message: torch GPU tensors are not supported, use ``examples.train --device cuda``).
"""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI

from tensorplay_mpi import SGD, DataParallel, Join
from tensorplay_mpi.data import batches, shard
from tensorplay_mpi.examples.evaluation import validate

from .train import MISSING_SKLEARN, epoch_done, header, init_mlp, load_digits_split, \
    make_parser, report

MISSING_TORCH = ("the torch demo needs PyTorch: pip install 'tensorplay-mpi[torch,examples]', "
                 "or from a clone pip install -e '.[torch,examples]'")
NO_CUDA = ("the torch demo runs on the CPU: tensorplay_mpi takes torch tensors on the CPU only; "
           "run tensorplay_mpi.examples.train --device cuda for the GPU demo (CuPy)")


def make_model(n_in: int, hidden: int, n_out: int, seed: int):
    """The demo's MLP as torch modules, with the NumPy demo's initial weights."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(n_in, hidden), torch.nn.Tanh(),
                                torch.nn.Linear(hidden, n_out))
    w1, b1, w2, b2 = init_mlp(n_in, hidden, n_out, seed)
    with torch.no_grad():
        for p, value in zip(model.parameters(), (w1.T, b1, w2.T, b2)):
            p.copy_(torch.from_numpy(np.ascontiguousarray(value)))
    return model


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.checkpoint:
        parser.error("--checkpoint: stop and resume are the NumPy demo's (examples.train)")
    if args.device != "cpu":
        raise SystemExit(NO_CUDA)
    try:
        import torch
    except ImportError:
        raise SystemExit(MISSING_TORCH) from None
    torch.set_num_threads(1)  # one core per rank, as the NumPy demo

    comm = MPI.COMM_WORLD
    try:
        (x_train, y_train), (x_test, y_test) = load_digits_split(args.seed)
    except ImportError:
        raise SystemExit(MISSING_SKLEARN) from None
    mine = shard(len(y_train), comm.rank, comm.size, args.skew)
    model = make_model(x_train.shape[1], args.hidden, 10, args.seed)
    dp = DataParallel(model.parameters(), comm=comm, buffers=model.buffers())
    opt = SGD(model.parameters(), dp.grads, lr=args.lr)
    header(comm, args, len(y_train), len(y_test))

    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        rng = np.random.default_rng([args.seed, epoch, comm.rank])
        totals = np.zeros(3)  # loss sum, correct, samples
        with Join([dp, opt], divide_by_initial_world_size=args.divide == "world"):
            for idx in batches(mine, args.batch_size, rng):
                x, y = torch.from_numpy(x_train[idx]), torch.from_numpy(y_train[idx])
                model.zero_grad()
                with dp.step():
                    logits = model(x)
                    loss = torch.nn.functional.cross_entropy(logits, y)
                    loss.backward()
                opt.step()
                totals += (loss.item() * len(idx), int((logits.argmax(1) == y).sum()), len(idx))
        with torch.no_grad():
            validation = validate(comm, lambda x: model(torch.from_numpy(x)), x_test, y_test,
                                  args.batch_size, args.skew, torch_metrics=True)
        epoch_done(comm, epoch, args.epochs, comm.allreduce(totals), validation)
    elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)

    with torch.no_grad():
        predicted = model(torch.from_numpy(x_test)).argmax(1).numpy()
    accuracy = float((predicted == y_test).mean())
    params = [p.detach().numpy() for p in model.parameters()]
    return report(comm, args, params, accuracy, elapsed, len(y_test))


if __name__ == "__main__":
    sys.exit(main())
