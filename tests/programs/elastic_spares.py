"""Training with hot spares that loses ranks (``make test-elastic``), checked against a replay.

    mpiexec --with-ft ulfm -n N python tests/programs/elastic_spares.py SPARES WIDTH
        [V@STEP:WHERE ...] [--hosts]

``elastic_run.py``'s training (a DataParallel over the sampler's log and a least-squares
``w``, SGD in an elastic Join, one Join per epoch, uneven shards), in a
:class:`~tensorplay_mpi.algorithms.SparePool` of N processes, the last SPARES of them spares:
each builds the same joinables on its own communicator and waits.  After a lost trainer the
survivors call ``pool.refill``: a spare takes the lost rank's place, receives the replicated
state and the Sampler re-splits the epoch's unconsumed samples over the restored width.

Victims as in ``elastic_run.py`` (world ranks), and ``V@STEP:spare``: the process of world
rank V, a waiting spare, is SIGKILLed by training rank 0 once its optimizer has applied STEP
updates.  WIDTH is the training width expected at the end.  With ``--hosts`` (``make
test-multihost``) the victims must be every process of one host, and the survivors on others.

Every process left prints ``RESULT rank=R ok ...`` or ``RESULT rank=R WRONG ...``: a trainer
(a recruit included) after ``elastic_run.py``'s checks (identical replicas, every sample
exactly once per epoch, the lost ranks are the trainers killed, ``w`` equal to a serial NumPy
replay of the log's sample ids), plus the width; a spare never recruited once the trainers
closed the pool.
"""

import os
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))  # elastic_run's training and checks
from elastic_run import (BATCH, DIM, EPOCHS, SAMPLES, die_if, gradients,  # noqa: E402
                         noted, plan, report)

from tensorplay_mpi import SGD, DataParallel, Join, RanksLostError  # noqa: E402
from tensorplay_mpi.algorithms import SparePool  # noqa: E402
from tensorplay_mpi.data import Sampler  # noqa: E402

SEED = 1


def main():
    spares, width = int(sys.argv[1]), int(sys.argv[2])
    world = MPI.COMM_WORLD
    pids = world.allgather(os.getpid())  # a spare's, for the trainer that kills it
    hosts = world.allgather(socket.gethostname())
    victims = plan([a for a in sys.argv[3:] if a != "--hosts"], world.size, SEED, ("top",))
    if "--hosts" in sys.argv and world.rank == 0:
        print(f"HOSTS {hosts} victims {sorted(victims)}", flush=True)
    killed = {v for v, (_, where, _) in victims.items() if where == "spare"}
    data = np.random.default_rng(1234)
    x, y = data.normal(size=(SAMPLES, DIM)), data.normal(size=SAMPLES)
    log = np.zeros((EPOCHS * SAMPLES // BATCH + 8, SAMPLES))
    w = np.zeros(DIM)
    pool = SparePool(world, spares)
    comm = pool.comm
    sampler = Sampler(SAMPLES, comm.rank, comm.size, batch_size=BATCH, seed=SEED, skew=1.0)
    dp = DataParallel([log, w], comm=comm)
    opt = SGD([log, w], dp.grads, lr=1.0)
    firsts, lost_seen = [], []
    members = list(range(world.size - spares))  # world ranks of the training comm
    if pool.spare:
        if not pool.wait([dp, opt], sampler):
            print(f"RESULT rank={world.rank} ok spare, not needed", flush=True)
            return
        comm, members, firsts, lost_seen = joined(pool.comm, world, None)
    for epoch in range(sampler.epoch, EPOCHS + 1):
        sampler.set_epoch(epoch)
        if len(firsts) < epoch:
            firsts.append(opt.steps)
        while True:
            try:
                with Join([dp, opt], elastic=True):
                    for idx in sampler:
                        die_if(victims, world.rank, "top", opt.steps)
                        kill_spares(victims, killed, comm, pids, opt.steps)
                        with dp.step():
                            gradients(dp, opt, idx, x, y, w, victims, world.rank)
                        opt.step()
                        die_if(victims, world.rank, "update", opt.steps)
                    die_if(victims, world.rank, "joined", opt.steps)
                break
            except RanksLostError as lost:
                members = noted(lost, members, lost_seen)
                sampler.shrink(lost.lost, lost.steps)
                comm = pool.refill(lost, [dp, opt], sampler)
                if comm is not lost.comm:  # a spare came in
                    comm, members, _, _ = joined(comm, world, (firsts, lost_seen))
    firsts.append(opt.steps)
    pool.close()
    trainers_lost = {v: plan_ for v, plan_ in victims.items() if v not in killed}
    report(comm, world, trainers_lost, log, w, x, y, firsts, lost_seen, [], None)
    if comm.size != width:
        print(f"RESULT rank={world.rank} WRONG width {comm.size}, expected {width}",
              flush=True)
    lost_hosts = {hosts[v] for v in victims}
    if "--hosts" in sys.argv and (len(lost_hosts) != 1 or hosts.count(hosts[min(victims)])
                                  != len(victims)):
        print(f"RESULT rank={world.rank} WRONG the victims {sorted(victims)} are not every "
              f"process of one host: {hosts}", flush=True)


def joined(comm, world, history):
    """The new training comm after a recruitment, the world ranks of its members, and the
    trainers' bookkeeping (the recruit's `history` is None: it takes a trainer's)."""
    members = comm.Get_group().Translate_ranks(list(range(comm.size)), world.Get_group())
    histories = comm.allgather(history)  # nothing of the library's is pending on comm
    firsts, lost_seen = next(h for h in histories if h is not None)
    return comm, list(members), list(firsts), list(lost_seen)


def kill_spares(victims, killed, comm, pids, applied):
    """Training rank 0 SIGKILLs each spare victim once STEP updates are applied."""
    if comm.rank != 0:
        return
    for victim in sorted(killed):
        step = victims[victim][0]
        if applied >= step and pids[victim]:
            print(f"KILLED spare at {time.time():.6f}", flush=True)
            os.kill(pids[victim], signal.SIGKILL)
            pids[victim] = 0


if __name__ == "__main__":
    main()
