"""Training that loses ranks and goes on (``make test-elastic``), checked against a replay.

    mpiexec --with-ft ulfm -n 3 python tests/programs/elastic_run.py SEED [--jc] [--update]
        [--save=DIR] [--validate] [V@STEP:WHERE ...]

A DataParallel over two float64 parameters, stepped by SGD in an elastic Join, one Join per
epoch, on uneven shards (``Sampler``, skew 1, so rank 0 joins early in every epoch):

- ``log`` (steps x samples): each step adds 1 at the ids of every active rank's batch (each
  rank's gradient is ``-size`` there, averaged over the world size): the sampler's log, as the
  model saw it;
- ``w``: least squares, each step ``w -= 0.01 * sum over the step's ids of x (x.w - y)``.

With ``--jc`` a JoinableComm joins them (``Join([dp, opt, jc])``): each step it sums the
batch sizes of the active ranks (checked against the log) in the step, so while a
rank has joined the Join follows one ordered stream; WHERE may then be ``jc`` (just before
that sum).  With ``--update`` the optimizer steps through ``DataParallel(update=...)`` instead
of ``Join([dp, opt])`` (the bound method of an object whose state dict is the optimizer's,
settled with the DataParallel).  With ``--save=DIR`` every active rank asks for a save every
4 steps and the Join's ``on_save`` writes a checkpoint there; WHERE may then be ``save`` (in
``on_save``, before the write), and after the run the last checkpoint must load whole: the
log's rows of its step as the run has them, none after.  With ``--validate`` each epoch ends with a
validation ``Join([jc], elastic=True)`` of a few JoinableComm allreduces; WHERE may be
``validate`` (in it): the training's joinables then move with ``lost.move`` and the sampler
takes the loss with the epoch done (``sampler.shrink(lost.lost)``).

Each victim V (a rank of COMM_WORLD, as are the losses reported) SIGKILLs itself once its
optimizer has applied STEP updates, at WHERE: ``top`` (before the step), ``backward`` (between
marking the two gradients ready), ``update`` (after the step, before the next heartbeat),
``joined`` (once it has run out of batches, at the epoch's end: it then dies while
shadowing) or ``random`` (a random one of these, and a random pause).  Without victims, the
seed draws one rank and one step.

Every survivor checks, after the last epoch: the parameters are bitwise identical on all
survivors; every sample was used exactly once per epoch (the log's rows of each epoch); the
lost ranks are the victims; and ``w`` equals a serial NumPy replay of the log (the same ids per
step, the updates in the same order).  It prints ``RESULT rank=R ok ...`` or ``RESULT rank=R
WRONG ...`` and exits 0.
"""

import hashlib
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from tensorplay_mpi import (SGD, DataParallel, Join, JoinableComm, RanksLostError, checkpoint,
                            request_save)
from tensorplay_mpi.data import Sampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the toys
from toys import Stepper  # noqa: E402

SAMPLES, BATCH, EPOCHS, DIM, LR = 240, 8, 3, 5, 0.01
WHERE = ("top", "backward", "update", "joined")
SAVE_EVERY = 4


def plan(argv, size, seed, places):
    """{victim: (step, where, pause)} from the arguments, else drawn from the seed."""
    rng = np.random.default_rng(seed)
    if not argv:
        argv = [f"{rng.integers(size)}@{rng.integers(1, 30)}:random"]
    victims = {}
    for item in argv:
        rank, rest = item.split("@")
        step, where = rest.split(":")
        if where == "random":
            where = places[rng.integers(len(places))]
        victims[int(rank)] = (int(step), where, float(rng.uniform(0, 0.004)))
    return victims




def gradients(dp, opt, idx, x, y, w, victims, world_rank):
    """A step's gradients, in two buckets: the least-squares gradient of the batch `idx`
    (weights `w`), then the sampler's log (row: the step, -size at each sample id), with the
    "backward" kill point between them."""
    row, size = opt.steps, dp.size
    dp.grads[1][...] = size * LR * x[idx].T @ (x[idx] @ w - y[idx])
    dp.mark_ready(1)
    die_if(victims, world_rank, "backward", opt.steps)
    dp.grads[0][...] = 0.0
    dp.grads[0][row, idx] = -size
    dp.mark_ready(0)


def die_if(victims, world_rank, where, applied):
    step, at, pause = victims.get(world_rank, (None, None, 0.0))
    if at == where and applied >= step:
        time.sleep(pause)
        print(f"KILLED at {time.time():.6f}", flush=True)  # the recovery time's start
        os.kill(os.getpid(), signal.SIGKILL)


def main():
    flags = [a for a in sys.argv[2:] if a.startswith("--")]
    seed, with_jc, with_update = int(sys.argv[1]), "--jc" in flags, "--update" in flags
    with_validate = "--validate" in flags
    save_dir = next((a.split("=", 1)[1] for a in flags if a.startswith("--save=")), None)
    world = MPI.COMM_WORLD
    places = WHERE + (("jc",) if with_jc else ()) + (("save",) if save_dir else ()) + (
        ("validate",) if with_validate else ())
    victims = plan([a for a in sys.argv[2:] if not a.startswith("--")], world.size, seed,
                   places)
    data = np.random.default_rng(1234)
    x, y = data.normal(size=(SAMPLES, DIM)), data.normal(size=SAMPLES)
    log = np.zeros((EPOCHS * SAMPLES // BATCH + 8, SAMPLES))
    w = np.zeros(DIM)
    comm = world
    sampler = Sampler(SAMPLES, comm.rank, comm.size, batch_size=BATCH, seed=seed, skew=1.0)
    stepper = Stepper()
    dp = DataParallel([log, w], comm=comm, update=stepper.step if with_update else None)
    opt = stepper.opt = SGD([log, w], dp.grads, lr=1.0)
    jc = JoinableComm(comm) if with_jc else None

    def on_save():
        die_if(victims, world.rank, "save", opt.steps)
        checkpoint.save(save_dir, [log, w], step=opt.steps, comm=dp.comm)
    sums = []  # (row, the active ranks' batch sizes summed by jc)
    lost_seen, firsts, members = [], [], list(range(world.size))  # members: world ranks
    for epoch in range(1, EPOCHS + 1):
        sampler.set_epoch(epoch)
        firsts.append(opt.steps)
        while True:
            try:
                owners = [dp] if with_update else [dp, opt]
                with Join(owners + ([jc] if jc else []), elastic=True,
                          on_save=on_save if save_dir else None):
                    for idx in sampler:
                        die_if(victims, world.rank, "top", opt.steps)
                        with dp.step():
                            if jc is not None:  # in the step: the DataParallel leads
                                die_if(victims, world.rank, "jc", opt.steps)
                                total = jc.allreduce(np.array([float(len(idx))]))
                                sums.append((opt.steps, float(total[0])))
                            gradients(dp, opt, idx, x, y, w, victims, world.rank)
                        if not with_update:
                            opt.step()
                        die_if(victims, world.rank, "update", opt.steps)
                        if save_dir and opt.steps % SAVE_EVERY == 0:
                            request_save(f"every {SAVE_EVERY} steps")
                    die_if(victims, world.rank, "joined", opt.steps)
                break
            except RanksLostError as lost:
                members = noted(lost, members, lost_seen)
                comm = lost.comm
                sampler.shrink(lost.lost, lost.steps)
        while with_validate:  # a validation Join of its own (the epoch's samples all used)
            try:
                vjc = JoinableComm(comm)
                with Join([vjc], elastic=True):
                    for _ in range(2 + comm.rank % 2):
                        vjc.begin_iteration()
                        die_if(victims, world.rank, "validate", opt.steps)
                        vjc.allreduce(np.ones(3))
                break
            except RanksLostError as lost:  # the training's joinables move too
                members = noted(lost, members, lost_seen)
                lost.move(*owners, *([jc] if jc else []))
                comm = lost.comm
                sampler.shrink(lost.lost)
    firsts.append(opt.steps)
    report(comm, world, victims, log, w, x, y, firsts, lost_seen, sums, save_dir)
    MPI.Finalize()


def noted(lost, members, lost_seen):
    """Record `lost` (its ranks as COMM_WORLD ranks); the members of the survivors' comm."""
    print(f"RECOVERED at {time.time():.6f}", flush=True)  # and training again
    gone = [members[r] for r in lost.lost]
    lost_seen.append((lost.old_size, gone, lost.step, lost.completed))
    return [m for m in members if m not in gone]


def report(comm, world, victims, log, w, x, y, firsts, lost_seen, sums, save_dir):
    problems = []
    if save_dir:
        saved = [np.zeros_like(log), np.zeros_like(w)]
        resumed = checkpoint.load(save_dir, saved, comm=comm, resize=True)
        if resumed is None:
            problems.append("no checkpoint loads")
        elif not (np.array_equal(saved[0][:resumed.step], log[:resumed.step])
                  and not saved[0][resumed.step:].any()):
            problems.append(f"the checkpoint of step {resumed.step} mixes steps")
    for row, total in sums:  # a redone step's first sum is checked against the step's log too
        if row < firsts[-1] and total < log[row].sum():
            problems.append(f"step {row + 1}: the JoinableComm summed {total:g} samples, "
                            f"the step used {log[row].sum():g}")
            break
    digest = hashlib.blake2b(log.tobytes() + w.tobytes(), digest_size=8).hexdigest()
    digests = comm.allgather(digest)
    if len(set(digests)) != 1:
        problems.append(f"replicas differ: {digests}")
    for e in range(EPOCHS):
        counts = log[firsts[e]:firsts[e + 1]].sum(axis=0)
        if not (counts == 1).all():
            problems.append(f"epoch {e + 1}: {int((counts == 0).sum())} samples never used, "
                            f"{int((counts > 1).sum())} more than once")
    if not np.isin(log, (0.0, 1.0)).all():
        problems.append("the log holds values other than 0 and 1")
    replay = np.zeros_like(w)
    for row in log[:firsts[-1]]:
        ids = np.flatnonzero(row)
        replay -= LR * x[ids].T @ (x[ids] @ replay - y[ids])
    if not np.allclose(w, replay, rtol=1e-10, atol=1e-12):
        problems.append(f"w differs from the serial replay by {np.abs(w - replay).max():.3g}")
    named = sorted(r for _, ranks, _, _ in lost_seen for r in ranks)
    expected = sorted(victims)
    if named != expected:
        problems.append(f"losses reported {lost_seen}, victims {expected}")
    verdict = "WRONG " + "; ".join(problems) if problems else "ok"
    print(f"RESULT rank={world.rank} {verdict} survivors={comm.size} steps={firsts[-1]} "
          f"losses={lost_seen} victims={victims}", flush=True)


if __name__ == "__main__":
    main()
