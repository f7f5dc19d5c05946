"""Random-signal trials of the demo's stop and resume, in one job (``make stop-trials``).

    mpiexec -n N python -m mpi4py tests/programs/stop_trials.py --trials 20 --dir DIR

First the demo trains once without stopping (the reference digest).  Then each trial runs it
with ``--checkpoint DIR/trial-K`` while a real signal (SIGTERM, SIGUSR1 or SIGINT, drawn by
rank 0) reaches one rank or every rank at a random moment of the run; a stopped run is resumed
from its checkpoint by a fresh run (new model, new DataParallel), as the same command would.
Each trial ends in one of:

  resumed   stopped, checkpointed, resumed: the reference digest
  finished  the signal came after the last Join: the run finished with the reference digest
  error     an exception on every rank (the job goes on with the next trial)
  WRONG     another digest, a failed run, or an exception on some ranks only

The job prints ``RESULT ranks=N resumed=.. finished=.. error=.. WRONG=..`` with the largest
signal-to-checkpoint latency, and exits 1 if any trial was WRONG.  A hang is the caller's
timeout.
"""

import argparse
import contextlib
import io
import os
import random
import re
import signal
import sys
import threading
import time

from mpi4py import MPI

from tensorplay_mpi import clear_stop, stop_on_signals
from tensorplay_mpi.examples import train

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
DEMO = ["--epochs", "2", "--hidden", "16", "--min-accuracy", "0"]


def run_demo(ctl, args):
    """Run the demo in this process: (status, digest or None, seconds), the same on all ranks."""
    out = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out):
            status = train.run(train.make_parser().parse_args(DEMO + args), MPI.COMM_WORLD)
        error = None
    except Exception as raised:  # judged on every rank below
        status, error = -1, f"{type(raised).__name__}: {raised}"
    seconds = time.perf_counter() - start
    found = re.search(r"digest ([0-9a-f]+)", out.getvalue())
    outcomes = ctl.allgather((status, error))
    digest = ctl.bcast(found.group(1) if found else None)
    return outcomes, digest, seconds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    ctl = MPI.COMM_WORLD.Dup()  # the harness's own blocking collectives: never a library one
    rank, size = ctl.rank, ctl.size
    counts = {"resumed": 0, "finished": 0, "error": 0, "WRONG": 0}
    latency = 0.0
    rng = random.Random(options.seed * 100 + size)
    with stop_on_signals():
        run_demo(ctl, [])  # warm: imports and the data set's first load
        (outcome, *_), reference, seconds = run_demo(ctl, [])
        seconds = ctl.bcast(seconds)
        for k in range(options.trials):
            draw = (rng.uniform(0, 1.2 * seconds), rng.choice(["all", rng.randrange(size)]),
                    rng.choice(SIGNALS))
            delay, target, signum = ctl.bcast(draw)
            fired = []

            def fire(signum=signum, fired=fired):
                fired.append(time.perf_counter())
                os.kill(os.getpid(), signum)

            timer = threading.Timer(delay, fire) if target in ("all", rank) else None
            checkpoint = ["--checkpoint", os.path.join(options.dir, f"trial-{k}")]
            ctl.Barrier()
            if timer is not None:
                timer.start()
            outcomes, digest, _ = run_demo(ctl, checkpoint)
            ended = time.perf_counter()
            if timer is not None:
                timer.cancel()
                timer.join()
            time.sleep(0.01)  # a signal sent just now reaches its handler before it is cleared
            ctl.Barrier()
            clear_stop()
            statuses = [status for status, _ in outcomes]
            stopped = statuses == [train.STOPPED] * size
            if stopped:
                if fired:
                    latency = max(latency, ended - fired[0])
                outcomes, digest, _ = run_demo(ctl, checkpoint)
                statuses = [status for status, _ in outcomes]
            if statuses == [0] * size and digest == reference:
                verdict = "resumed" if stopped else "finished"
            elif statuses == [-1] * size:
                verdict = "error"
            else:
                verdict = "WRONG"
            counts[verdict] += 1
            if rank == 0 and verdict in ("error", "WRONG"):
                print(f"trial {k} ({signal.Signals(signum).name} to {target} after "
                      f"{delay:.3f} s): {verdict}: {outcomes} digest {digest} (reference "
                      f"{reference})", flush=True)
    latency = ctl.allreduce(latency, op=MPI.MAX)
    if rank == 0:
        text = " ".join(f"{k}={v}" for k, v in counts.items())
        print(f"RESULT ranks={size} {text} max_stop_latency_ms={latency * 1e3:.1f} "
              f"(reference run {seconds:.2f} s, outcome {outcome})", flush=True)
    return 1 if counts["WRONG"] else 0


if __name__ == "__main__":
    sys.exit(main())
