"""A torch model that loses a rank and goes on (``make test-elastic``), against serial torch.

    mpiexec --with-ft ulfm -n 4 python tests/programs/elastic_torch.py DIR OPT NORM EXPECT \
        V@STEP:WHERE

A Conv1d - BatchNorm1d - tanh - Linear model, float64, stepped through
``DataParallel(..., buffers=model.buffers(), update=...)`` in ``Join([dp], elastic=True)``
(``Join([dp, jc])`` with SyncBatchNorm), one Join per epoch, on uneven shards (``Sampler``,
skew 0.5).  OPT: ``torch`` (``update=opt.step`` of ``torch.optim.SGD`` with momentum) or
``library`` (this library's ``Adam`` bound to ``dp.grads``, stepped by the bound method of an
object whose state dict is the optimizer's).  NORM: ``none`` (no BatchNorm layer), ``plain``
(``torch.nn.BatchNorm1d``, its buffers broadcast), ``sync`` (``SyncBatchNorm`` through a
JoinableComm, ``Join([dp, jc])``) or ``natural`` (``SyncBatchNorm`` converted without a group,
``Join([dp])``: through the JoinableComm the DataParallel brings).

The victim V (a rank of COMM_WORLD) SIGKILLs itself in its step once DataParallel has counted
STEP steps, at WHERE: ``forward`` (after the forward pass, before the backward: the
survivors' forward passes moved the running statistics, and no survivor completes the step)
or ``bucket`` (in the bucket allreduce: the victim starts it last, 0.3 s after the others, and
dies at once; at 4 ranks with victim 1 Open MPI's binomial allreduce then completes on ranks 0
and 2 and not on rank 3, so the step is applied on some survivors only).  EXPECT says which
settle must have happened: ``split`` (some survivor adopted a step it had not completed),
``redo`` (a step was redone: no survivor completed it) or ``any``.

Each active rank appends, at the start of each step, a line to ``DIR/records.RANK``: the
number of losses it has seen, the epoch, ``dp.steps``, the world size and its rank then, and
its batch's ids.  A step's records are those of the most losses seen (a redone step's first
attempt is superseded).  Every survivor checks, after the last epoch: every sample used exactly
once per epoch; the model (parameters and running statistics) and the optimizer's state
bitwise identical on all survivors; and the model equal, to 1e-10, to a serial torch replay
of the records: each step's ranks' batches through one model (plain BatchNorm: each rank's
batch on its own, the running statistics those of the highest rank's batch; SyncBatchNorm:
their concatenation through ``torch.nn.BatchNorm1d``), the sum of the ranks' mean losses
divided by the world size, then ``torch.optim.SGD`` or ``torch.optim.Adam``.  It prints
``RESULT rank=R ok ...`` or ``RESULT rank=R WRONG ...``.
"""

import hashlib
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

from tensorplay_mpi import Adam, DataParallel, Join, JoinableComm, RanksLostError
from tensorplay_mpi.data import Sampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the toys
from toys import Stepper  # noqa: E402

SAMPLES, BATCH, EPOCHS, LENGTH = 120, 5, 2, 6
LR = {"torch": 0.05, "library": 0.02}
torch.set_default_dtype(torch.float64)




def make_model(norm):
    """The model, the same on every rank (seeded)."""
    torch.manual_seed(0)
    layers = [torch.nn.Conv1d(2, 4, 3, bias=norm == "none")]  # no bias before BatchNorm:
    if norm != "none":  # its gradient would be rounding noise, which Adam scales up
        layers.append(torch.nn.BatchNorm1d(4))
    layers += [torch.nn.Tanh(), torch.nn.Flatten(), torch.nn.Linear(4 * (LENGTH - 2), 1)]
    return torch.nn.Sequential(*layers)


def data():
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, 2, LENGTH, generator=generator)
    return x, x.sum(dim=(1, 2)).sin().unsqueeze(1)


def torch_optimizer(kind, params):
    if kind == "torch":
        return torch.optim.SGD(params, lr=LR[kind], momentum=0.9)
    return torch.optim.Adam(params, lr=LR[kind])


def main():
    directory, kind, norm, expect = sys.argv[1:5]
    victims = {int(v): (int(s), where) for v, rest in (a.split("@") for a in sys.argv[5:])
               for s, where in [rest.split(":")]}
    world = MPI.COMM_WORLD
    x, y = data()
    model = make_model(norm)
    joinables = []
    comm = world
    if norm in ("sync", "natural"):
        from tensorplay_mpi import SyncBatchNorm
        if norm == "sync":
            joinables.append(JoinableComm(comm))
        model = SyncBatchNorm.convert_sync_batchnorm(model, *joinables)
    if kind == "torch":
        opt = torch_optimizer(kind, model.parameters())
        dp = DataParallel(model.parameters(), comm=comm, buffers=model.buffers(),
                          update=opt.step)
    else:
        stepper = Stepper()
        dp = DataParallel(model.parameters(), comm=comm, buffers=model.buffers(),
                          update=stepper.step)
        opt = stepper.opt = Adam(list(model.parameters()), dp.grads, lr=LR[kind])
    sampler = Sampler(SAMPLES, comm.rank, comm.size, batch_size=BATCH, seed=7, skew=0.5)
    records = open(Path(directory) / f"records.{world.rank}", "a", buffering=1)
    losses, completed = 0, []
    for epoch in range(1, EPOCHS + 1):
        sampler.set_epoch(epoch)
        while True:
            try:
                with Join([dp, *joinables], elastic=True):
                    for idx in sampler:
                        model.zero_grad()
                        with dp.step():
                            records.write(f"{losses} {epoch} {dp.steps} {dp.size} {dp.rank} "
                                          f"{' '.join(map(str, idx))}\n")
                            loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
                            step, where = victims.get(world.rank, (None, None))
                            if where == "forward" and dp.steps >= step:
                                die()
                            if where == "bucket" and dp.steps >= step:
                                time.sleep(0.3)  # the last to start its bucket allreduce
                                loss.backward()
                                die()
                            loss.backward()
                break
            except RanksLostError as lost:
                losses += 1
                completed.append(lost.completed)
                comm = lost.comm
                sampler.shrink(lost.lost, lost.steps)
    records.close()
    report(comm, world, directory, kind, norm, expect, model, opt, x, y, losses, completed)


def die():
    print(f"KILLED at {time.time():.6f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def read_records(directory):
    """{step: [(epoch, size, rank, ids)]} from every rank's records, each step from the
    attempt that saw the most losses."""
    attempts = {}
    for path in Path(directory).glob("records.*"):
        for line in path.read_text().splitlines():
            gen, epoch, step, size, rank, *ids = map(int, line.split())
            attempts.setdefault(step, {}).setdefault(gen, []).append(
                (epoch, size, rank, np.array(ids)))
    return {step: sorted(by_gen[max(by_gen)], key=lambda r: r[2])
            for step, by_gen in sorted(attempts.items())}, attempts


def replay(steps, kind, norm, x, y):
    """The serial run of the recorded steps: the model and its optimizer after them."""
    model = make_model(norm)
    opt = torch_optimizer(kind, model.parameters())
    params = list(model.parameters())
    for ranks in steps:
        size = ranks[0][1]
        if norm in ("sync", "natural"):
            ids = np.concatenate([r[3] for r in ranks])
            out = model(x[ids])
            bounds = np.cumsum([0] + [len(r[3]) for r in ranks])
            loss = sum(torch.nn.functional.mse_loss(out[a:b], y[r[3]])
                       for a, b, r in zip(bounds[:-1], bounds[1:], ranks))
            grads = torch.autograd.grad(loss / size, params)
        else:
            before = [b.clone() for b in model.buffers()]
            grads = [torch.zeros_like(p) for p in params]
            for *_, ids in ranks:  # each rank's batch from the same buffers; the highest's
                for buffer, kept in zip(model.buffers(), before):  # running statistics stay
                    buffer.copy_(kept)
                loss = torch.nn.functional.mse_loss(model(x[ids]), y[ids])
                grads = [g + d / size for g, d in zip(grads, torch.autograd.grad(loss, params))]
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    return model


def digest(model, opt):
    tensors = [t.detach().numpy().tobytes() for t in model.state_dict().values()]
    state = opt.state_dict()["state"]
    for i in sorted(state):
        tensors += [np.asarray(v).tobytes() for _, v in sorted(state[i].items())]
    return hashlib.blake2b(b"".join(tensors), digest_size=8).hexdigest()


def report(comm, world, directory, kind, norm, expect, model, opt, x, y, losses, completed):
    problems = []
    steps, attempts = read_records(directory)
    if list(steps) != list(range(1, len(steps) + 1)):
        problems.append(f"steps recorded {list(steps)}")
    for epoch in range(1, EPOCHS + 1):
        used = np.concatenate([r[3] for ranks in steps.values() for r in ranks
                               if r[0] == epoch])
        counts = np.bincount(used, minlength=SAMPLES)
        if not (counts == 1).all():
            problems.append(f"epoch {epoch}: {int((counts == 0).sum())} samples never used, "
                            f"{int((counts > 1).sum())} more than once")
    digests = comm.allgather(digest(model, opt))
    if len(set(digests)) != 1:
        problems.append(f"replicas differ (model and optimizer state): {digests}")
    serial = replay(list(steps.values()), kind, norm, x, y)
    for (name, got), want in zip(model.state_dict().items(), serial.state_dict().values()):
        if not torch.allclose(got.to(want.dtype), want, rtol=1e-10, atol=1e-12):
            problems.append(f"{name} differs from the serial replay by "
                            f"{(got.to(want.dtype) - want).abs().max().item():.3g}")
    split = any(comm.allgather(any(completed)))
    redone = any(len(by_gen) > 1 for by_gen in attempts.values())
    settled = "split" if split else "redo" if redone else "none"
    if losses != 1 or expect not in ("any", settled):
        problems.append(f"{losses} losses, settled {settled}, expected {expect}")
    verdict = "WRONG " + "; ".join(problems) if problems else "ok"
    print(f"RESULT rank={world.rank} {verdict} survivors={comm.size} steps={len(steps)} "
          f"settled={settled}", flush=True)


if __name__ == "__main__":
    main()
