"""``make test-elastic``: ranks SIGKILLed under Open MPI's ULFM (``mpiexec --with-ft ulfm``).

    python tests/programs/elastic_cases.py [RANDOM_RUNS] [DEMO_TRIALS] [EXIT_TRIALS]

1. Without ``elastic``: in a step, while a rank has joined and in a JoinableComm loop, every
   survivor raises PeerFailureError naming the lost rank and exits cleanly (``lost_rank.py``).
2. With ``elastic``, at 3 and 4 ranks (``elastic_run.py``, checked there against a serial
   replay of the sampler's log): a loss at each point of a step (the heartbeat, between two
   gradients, after the update, while the victim has joined, in a JoinableComm operation, in
   ``on_save`` while a checkpoint is written: the last one must load whole), rank 0 lost, a
   loss while another rank has joined (rank 0 joins early in every epoch), two losses one after
   the other, two at once, one that leaves a single rank; the step applied by the Join's
   optimizer or by ``DataParallel(update=...)``.
3. A torch model (``elastic_torch.py``, against a serial torch replay of the same sample ids):
   a rank killed in the bucket allreduce at 4 ranks, so that the step completes on some
   survivors only (the optimizer stepped by ``update=``, torch's SGD with momentum or this
   library's Adam, must come with the state adopted), and a rank killed after its forward pass,
   so that nobody completes the step and it is redone (BatchNorm and SyncBatchNorm: the running
   statistics the forward passes moved must be those of the last completed step; SyncBatchNorm
   in ``Join([dp, jc])`` and converted without a group in ``Join([dp])``).
4. A JoinableComm loop that sums its batches into a kept array (``elastic_kept.py``): the
   last active rank lost while the others have joined, or another rank: the survivors' total
   is NumPy's sum of every batch summed before the loss (nothing reduced is lost).
5. RANDOM_RUNS runs (default 6) at 3 and at 4 ranks, each with a victim, a step, a point and
   a pause drawn from its seed.
6. EXIT_TRIALS runs (default 12) of a JoinableComm loop that loses rank 0, 1 or 2 before or
   after a collective and exits with status 0 or 3, MPI finalized at exit or explicitly
   (``elastic_exit_trials.py``): the launcher must exit with that status.
7. DEMO_TRIALS trials (default 3) of the demo, ``examples.train --elastic`` at 3 ranks, one
   rank SIGKILLed from outside at a random moment (``elastic_demo_trials.py``).

ZeRO: a ZeroRedundancyOptimizer with copies (``elastic_zero.py``, against a serial NumPy replay
of the sampler's log, per-parameter step counts included), run after 4: a loss at each point
of a step (before it; in the gradients' allreduce, so that some survivors applied the step and
some did not; after its shard update; during its parameter broadcast; after it; while the
victim has joined), two losses at once and one after the other, one in a validation Join
(ZeRO moved with ``lost.move``); two neighbours lost at once must be refused on every
survivor.

Prints one line per run and fails on the first wrong one: wrong results, an abort, or a job
that has not ended within TIMEOUT_S, whether its ranks hang (in their work or in
``MPI_Finalize``) or only the launcher is left (``launcher hang``).
"""

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

PY = ".venv-ompi/bin/python"
RUN = [".venv-ompi/bin/mpiexec", "--oversubscribe", "--with-ft", "ulfm"]
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
TIMEOUT_S = 180  # a whole job, on a loaded machine (4 ranks importing torch on 2 cores)

CASES = [  # (ranks, arguments of elastic_run.py after the seed)
    (2, ["1@5:top"]), (2, ["0@7:backward"]),
    (3, ["2@10:top"]), (3, ["1@12:backward"]), (3, ["2@7:update"]), (3, ["2@14:joined"]),
    (3, ["0@5:top"]), (3, ["0@3:joined"]), (3, ["--jc", "1@4:jc"]), (3, ["--jc", "2@9:joined"]),
    (4, ["3@6:top"]), (4, ["1@9:backward"]), (4, ["0@2:update"]), (4, ["--jc", "2@5:jc"]),
    (3, ["0@4:top", "2@20:backward"]), (4, ["1@3:update", "3@16:top"]),
    (3, ["1@2:update", "2@2:update"]), (4, ["0@8:top", "1@8:top"]),
    (3, ["--update", "1@5:top"]), (3, ["--update", "2@9:backward"]),
    (4, ["--update", "0@3:update"]),
    (3, ["--save=DIR", "1@6:save"]), (3, ["--save=DIR", "0@8:save"]),
    (4, ["--save=DIR", "--update", "2@10:save"]),
    (3, ["--validate", "1@15:validate"]), (4, ["--validate", "--jc", "0@20:validate"]),
]

# Hot spares (elastic_spares.py, against the same replay): a lost trainer whose place a spare
# takes (the width restored), a lost spare (nothing changes), more losses than spares (a
# replacement, then a shrink), a recruit lost and replaced by the second spare, a spare lost
# and then a trainer (the pool's shrink finds no spare).
SPARE_CASES = [  # (processes, arguments of elastic_spares.py: spares, final width, victims)
    (4, ["1", "3", "1@5:top"]), (3, ["1", "2", "0@7:update"]),  # a spare takes the place
    (4, ["1", "3", "3@4:spare"]),  # a lost spare: nothing changes for the trainers
    (4, ["1", "2", "3@3:spare", "1@10:top"]),  # then a lost trainer: no spare left, a shrink
    (4, ["1", "2", "0@3:top", "2@12:backward"]),  # more losses than spares: then a shrink
    (4, ["2", "2", "0@4:top", "2@15:top"]),  # the recruit lost, the second spare comes in
]

ZERO_CASES = [  # (ranks, arguments of elastic_zero.py): ZeRO with copies, a loss at each point
    (3, ["2@7:top"]), (3, ["1@5:backward"]), (3, ["1@6:shard"]), (3, ["2@9:sync"]),
    (3, ["2@7:update"]), (3, ["2@14:joined"]), (3, ["0@4:sync"]),
    (4, ["--expect-split", "1@0:bucket"]), (4, ["3@6:shard"]), (4, ["--sgd", "2@8:sync"]),
    (4, ["0@5:top", "2@5:top"]),
    (4, ["1@3:update", "3@16:top"]), (3, ["--expect-gone", "1@5:top", "2@5:top"]),
    (3, ["--validate", "1@15:validate"]), (4, ["--validate", "0@20:validate"]),
]

KEPT_CASES = [  # (ranks, arguments of elastic_kept.py): victim, its batch, before/after
    (3, ["2", "18", "before"]), (3, ["2", "18", "after"]), (4, ["3", "26", "after"]),
    (3, ["1", "10", "after"]), (3, ["0", "3", "before"]),
]

TORCH_CASES = [  # (ranks, arguments of elastic_torch.py after its directory)
    (4, ["torch", "none", "split", "1@3:bucket"]), (4, ["library", "none", "split", "1@3:bucket"]),
    (3, ["torch", "plain", "redo", "1@4:forward"]), (3, ["library", "sync", "redo", "2@4:forward"]),
    (4, ["torch", "plain", "any", "1@3:bucket"]), (4, ["library", "sync", "any", "0@5:bucket"]),
    (3, ["library", "natural", "redo", "2@4:forward"]),  # SyncBatchNorm in Join([dp])
    (4, ["torch", "natural", "any", "1@3:bucket"]),
]


def ranks_alive(session, program):
    """The rank processes of the job in `session` (a launch's process group) still running."""
    out = subprocess.run(["ps", "-eo", "sid=,pid=,args="], capture_output=True,
                         text=True).stdout
    rows = [line.split(None, 2) for line in out.splitlines()]
    return [args for sid, _, args in (r for r in rows if len(r) == 3)
            if sid == str(session) and args.split()[0].endswith("python") and program in args]


def launch(ranks, program, args):
    """Run the job; (output, exit status).  A job still running after TIMEOUT_S is killed:
    status ``"launcher hang"`` when every rank process had exited, else ``"timeout"``."""
    job = subprocess.Popen([*RUN, "-n", str(ranks), PY, program, *args], env=ENV,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        out, _ = job.communicate(timeout=TIMEOUT_S)
        return out, job.returncode
    except subprocess.TimeoutExpired:
        alive = ranks_alive(job.pid, program)
        os.killpg(job.pid, signal.SIGKILL)
        out, _ = job.communicate()
        return (out, "launcher hang") if not alive else (f"{out}\nHANG: {alive}", "timeout")


def run(ranks, program, args, survivors):
    """Run `program` at `ranks` ranks; True when `survivors` ranks print ``RESULT ... ok``
    and the job ends by itself with status 0."""
    start = time.monotonic()
    out, status = launch(ranks, program, args)
    results = [line for line in out.splitlines() if line.startswith("RESULT")]
    killed = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("KILLED")]
    back = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("RECOVER")]
    recovery = (f"  recovered in {max(back) - min(killed):.2f} s" if len(killed) == 1 and back
                else "")
    ok = sum(" ok " in f"{line} " for line in results) == survivors and len(results) == survivors
    ok = ok and status == 0
    print(f"{'ok   ' if ok else 'WRONG'} {ranks} ranks {' '.join(args):32} exit {status} "
          f"in {time.monotonic() - start:.1f} s{recovery}", flush=True)
    if not ok:
        print(out[-4000:], flush=True)
    return ok


def main():
    random_runs = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    demo_trials = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    exit_trials = int(sys.argv[3]) if len(sys.argv) > 3 else 12
    checks = [(3, "tests/programs/lost_rank.py", [where], 2) for where in ("step", "joined", "jc")]
    scratch = tempfile.mkdtemp(prefix="tensorplay-elastic-")
    checks += [(n, "tests/programs/elastic_run.py",
                ["1", *(a.replace("DIR", f"{scratch}/{k}") for a in args)],
                n - sum(not a.startswith("--") for a in args))
               for k, (n, args) in enumerate(CASES)]
    checks += [(n, "tests/programs/elastic_torch.py", [f"{scratch}/torch{k}", *args], n - 1)
               for k, (n, args) in enumerate(TORCH_CASES)]
    checks += [(n, "tests/programs/elastic_kept.py", args, n - 1) for n, args in KEPT_CASES]
    checks += [(n, "tests/programs/elastic_spares.py", args, n - len(args) + 2)
               for n, args in SPARE_CASES]
    checks += [(n, "tests/programs/elastic_zero.py", args,
                n - sum(not a.startswith("--") for a in args)) for n, args in ZERO_CASES]
    seeds = random.Random(int(time.time())).sample(range(10_000), random_runs)
    checks += [(n, "tests/programs/elastic_run.py", [str(s)], n - 1) for s in seeds
               for n in (3, 4)]
    try:
        for ranks, program, args, survivors in checks:
            if program.endswith("elastic_torch.py"):
                os.makedirs(args[0])
            if not run(ranks, program, args, survivors):
                return 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if exit_trials and subprocess.run([PY, "tests/programs/elastic_exit_trials.py",
                                       str(exit_trials), "0"], env=ENV).returncode:
        return 1
    if demo_trials:
        return subprocess.run([PY, "tests/programs/elastic_demo_trials.py", str(demo_trials),
                               "3"], env=ENV).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
