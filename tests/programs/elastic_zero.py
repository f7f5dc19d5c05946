"""A ZeroRedundancyOptimizer that loses ranks and goes on (``make test-elastic``), checked
against a serial replay.

    mpiexec --with-ft ulfm -n 4 python tests/programs/elastic_zero.py [--sgd] V@STEP:WHERE ...

``Join([dp, zero], elastic=True)``, one Join per epoch, on uneven shards (``Sampler``, skew 1:
rank 0 joins early in every epoch), ZeRO with ``copies=True`` over four float64 parameters,
each rank owning at least one: ``w`` (least squares), ``big`` (broadcast on its own, in
place: over 1 MiB), ``log`` (steps x samples: each step's gradient is -1 at the ids of every
active rank's batch, so the log's nonzeros are the sampler's log as the model saw it) and
``b`` (used only in even-numbered steps: every rank passes it as unused in the others, so
its per-parameter step count differs from the others').  Adam by default, SGD with momentum
with ``--sgd``.

Each victim V (a rank of COMM_WORLD) SIGKILLs itself once ZeRO has applied STEP updates, at
WHERE: the points of ``elastic_run.py`` (``top``, ``backward``, ``update``, ``joined``); or
``shard`` (in ZeRO's step, after its shard's and copy's update, before the parameter
broadcast), ``sync`` (with the broadcasts started, before they are waited: some survivors
may have received part of them) - both also while the victim has joined, in its hook; or
``bucket`` (each parameter has a bucket of its own; the victim lets the others' buckets
reduce, starts the last one, ``w``'s, 0.3 s after the others and dies at once: at 4 ranks,
Open MPI's allreduce then completes on some survivors only, so some applied the step and
some did not: ``--expect-split`` checks that it happened).  Two victims that are neighbours
(r, r + 1 mod the size) at one point lose a shard with its copy: the survivors must then all
raise the error that says so (``--expect-gone``).  With ``--validate`` each epoch ends with a
validation ``Join([jc], elastic=True)``; WHERE may be ``validate`` (in it): ZeRO then moves
with ``lost.move``, re-sharded from its copies there.

Every survivor checks, after the last epoch: the parameters are bitwise identical on all
survivors; every sample was used exactly once per epoch (the log's nonzeros); the lost ranks
are the victims; and the parameters, the consolidated optimizer state (moments or momentum
buffers) and the per-parameter step counts equal a serial NumPy replay of the log's steps
(``tests/textbook.py``'s rules), to a relative 1e-9 (the gradients are sums in another order:
the replay's rounding differs by a few ulps, which Adam's normalisation does not amplify).
It prints ``RESULT rank=R ok ...`` or ``RESULT rank=R WRONG ...`` and exits 0.
"""

import hashlib
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))  # elastic_run's machinery
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the textbook rules
from elastic_run import die_if, noted, plan  # noqa: E402
from textbook import step as textbook_step  # noqa: E402

from tensorplay_mpi import SGD, Adam, DataParallel, Join, JoinableComm  # noqa: E402
from tensorplay_mpi import RanksLostError  # noqa: E402
from tensorplay_mpi import ZeroRedundancyOptimizer  # noqa: E402
from tensorplay_mpi.data import Sampler  # noqa: E402

SAMPLES, BATCH, EPOCHS, DIM, LR, BIG = 160, 8, 3, 5, 0.01, 140_000
WHERE = ("top", "backward", "update", "joined", "shard", "sync", "bucket", "validate")
HYPER = {"adam": {"lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-8},
         "sgd_momentum": {"lr": 0.01, "momentum": 0.9}}
ROWS = EPOCHS * SAMPLES // BATCH + 8
W_I, BIG_I, LOG_I, B_I = range(4)  # buckets of their own, reduced from the last to the first


def gradients(row, ids, x, y, w):
    """The gradients of step `row` (from 0) with batch `ids`: w, big, log, b (None: unused)."""
    g_log = np.zeros((ROWS, SAMPLES))
    g_log[row, ids] = -1.0
    return [LR * x[ids].T @ (x[ids] @ w - y[ids]), np.full(BIG, 1e-3 * len(ids)), g_log,
            np.full(3, 0.01 * len(ids)) if row % 2 == 0 else None]


def model():
    return [np.zeros(DIM), np.zeros(BIG), np.zeros((ROWS, SAMPLES)), np.zeros(3)]


def progress(seconds):
    """Let MPI progress the collectives in flight (it does so only inside MPI calls)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        MPI.COMM_WORLD.Iprobe()
        time.sleep(0.001)


def main():
    flags = [a for a in sys.argv[1:] if a.startswith("--")]
    kind = "sgd_momentum" if "--sgd" in flags else "adam"
    expect_gone, expect_split = "--expect-gone" in flags, "--expect-split" in flags
    validate = "--validate" in flags
    world = MPI.COMM_WORLD
    victims = plan([a for a in sys.argv[1:] if not a.startswith("--")], world.size, 1, WHERE)
    data = np.random.default_rng(1234)
    x, y = data.normal(size=(SAMPLES, DIM)), data.normal(size=SAMPLES)
    params = model()
    comm = world
    sampler = Sampler(SAMPLES, comm.rank, comm.size, batch_size=BATCH, seed=3, skew=1.0)
    dp = DataParallel(params, comm=comm, bucket_cap_mb=1e-5)  # a bucket per parameter
    zero = ZeroRedundancyOptimizer(params, dp.grads, Adam if kind == "adam" else SGD,
                                   comm=comm, copies=True, **HYPER[kind])
    kill_inside(zero, victims, world.rank)
    lost_seen, firsts, members, gone = [], [], list(range(world.size)), None
    for epoch in range(1, EPOCHS + 1):
        sampler.set_epoch(epoch)
        firsts.append(zero.elastic_progress())
        while gone is None:
            try:
                with Join([dp, zero], elastic=True):
                    for idx in sampler:
                        die_if(victims, world.rank, "top", zero.elastic_progress())
                        row, size = zero.elastic_progress(), dp.size
                        grads = gradients(row, idx, x, y, params[W_I])
                        at, where, _ = victims.get(world.rank, (0, None, 0.0))
                        late = where == "bucket" and row >= at
                        with dp.step(unused=[B_I] if grads[B_I] is None else ()):
                            for i in reversed(range(len(grads))):  # as a backward pass
                                if grads[i] is not None:
                                    dp.grads[i][...] = size * grads[i]
                                    if late and i == W_I:  # the others' buckets reduced,
                                        progress(0.3)  # the last started here last
                                    dp.mark_ready(i)
                                    if late and i != W_I:
                                        progress(0.05)
                                if i == LOG_I:
                                    die_if(victims, world.rank, "backward", row)
                            if late:
                                die_if(victims, world.rank, "bucket", row)
                        zero.step()
                        die_if(victims, world.rank, "update", zero.elastic_progress())
                    die_if(victims, world.rank, "joined", zero.elastic_progress())
                break
            except RanksLostError as lost:
                members = noted(lost, members, lost_seen)
                comm = lost.comm
                sampler.shrink(lost.lost, lost.steps)
            except RuntimeError as error:  # a shard lost with its copy: said on every survivor
                gone = str(error)
        if gone is not None:
            break
        while validate:  # a validation Join of its own: the training's joinables move
            try:
                jc = JoinableComm(comm)
                with Join([jc], elastic=True):
                    for _ in range(2 + comm.rank % 2):
                        jc.begin_iteration()
                        die_if(victims, world.rank, "validate", zero.elastic_progress())
                        jc.allreduce(np.ones(3))
                break
            except RanksLostError as lost:  # ZeRO re-shards from its copies in the move
                members = noted(lost, members, lost_seen)
                lost.move(dp, zero)
                comm = lost.comm
                sampler.shrink(lost.lost)
    firsts.append(zero.elastic_progress())
    if gone is not None:
        ok = expect_gone and "is gone: its copy was on rank" in gone
        print(f"RESULT rank={world.rank} {'ok' if ok else 'WRONG'} refused: {gone}", flush=True)
    else:
        report(comm, world, victims, kind, params, zero, x, y, firsts, lost_seen, expect_gone,
               expect_split)


def kill_inside(zero, victims, world_rank):
    """The points ``shard`` and ``sync`` inside ZeRO's step (active, or in a joined rank's
    hook): wrap its parameter sync and the wait for it."""
    sync, wait_all = zero._sync_parameters, zero._wait_all
    inside = []

    def wrapped_sync():
        die_if(victims, world_rank, "shard", zero.elastic_progress())
        inside.append(True)
        try:
            sync()
        finally:
            inside.clear()

    def wrapped_wait(works):
        works = list(works)
        if inside:
            time.sleep(0.002)  # the broadcasts on their way
            die_if(victims, world_rank, "sync", zero.elastic_progress())
        wait_all(works)
    zero._sync_parameters, zero._wait_all = wrapped_sync, wrapped_wait


def replay(kind, log, steps, x, y):
    """The serial run of the log's steps: parameters, state and per-parameter step counts."""
    params = model()
    states, counts = [{} for _ in params], [0] * len(params)
    for row in range(steps):
        ids = np.flatnonzero(log[row])
        for i, g in enumerate(gradients(row, ids, x, y, params[W_I])):
            if g is not None:
                counts[i] += 1
                params[i] = textbook_step(kind, HYPER[kind], params[i], g, states[i], counts[i])
    return params, states, counts


def report(comm, world, victims, kind, params, zero, x, y, firsts, lost_seen, expect_gone,
           expect_split):
    problems = ["the losses were survived, not refused"] if expect_gone else []
    split = any(comm.allgather(any(completed for *_, completed in lost_seen)))
    if expect_split and not split:
        problems.append("no survivor had the interrupted step completed from another")
    log = params[LOG_I]
    digests = comm.allgather(hashlib.blake2b(b"".join(p.tobytes() for p in params),
                                             digest_size=8).hexdigest())
    if len(set(digests)) != 1:
        problems.append(f"replicas differ: {digests}")
    for e in range(EPOCHS):
        counts = (log[firsts[e]:firsts[e + 1]] != 0).sum(axis=0)
        if not (counts == 1).all():
            problems.append(f"epoch {e + 1}: {int((counts == 0).sum())} samples never used, "
                            f"{int((counts > 1).sum())} more than once")
    steps = firsts[-1]
    if log[steps:].any():
        problems.append(f"the log has rows after step {steps}")
    expected, states, counts = replay(kind, log, steps, x, y)
    for name, mine, theirs in zip(("w", "big", "log", "b"), params, expected):
        if not np.allclose(mine, theirs, rtol=1e-9, atol=1e-15):
            problems.append(f"{name} differs from the serial replay by "
                            f"{np.abs(mine - theirs).max():.3g}")
    zero.consolidate_state_dict(to=0)
    if comm.rank == 0:
        full = zero.state_dict()
        if full["param_steps"].tolist() != counts or full["steps"] != steps:
            problems.append(f"step counts {full['steps']}, {full['param_steps'].tolist()}; "
                            f"the replay's {steps}, {counts}")
        names = {"exp_avg": "m", "exp_avg_sq": "v", "momentum_buffer": "b"}
        for i, state in enumerate(states):
            for name, ours in full["state"][i].items():
                if not np.allclose(ours, state[names[name]], rtol=1e-9, atol=1e-15):
                    problems.append(f"parameter {i}'s {name} differs from the replay's")
    named = sorted(r for _, ranks, _, _ in lost_seen for r in ranks)
    if named != sorted(victims):
        problems.append(f"losses reported {lost_seen}, victims {sorted(victims)}")
    problems = sum(comm.allgather(problems), [])  # rank 0's state checks for every rank
    verdict = "WRONG " + "; ".join(dict.fromkeys(problems)) if problems else "ok"
    print(f"RESULT rank={world.rank} {verdict} survivors={comm.size} steps={steps} "
          f"losses={lost_seen} victims={victims}", flush=True)


if __name__ == "__main__":
    main()
    MPI.Finalize()
