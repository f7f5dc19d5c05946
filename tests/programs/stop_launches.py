"""Random-signal trials of the demo as real jobs, signalled and run again (``make stop-trials``).

    python tests/programs/stop_launches.py --ranks 1 2 3 4 --trials 3 --dir DIR

For each rank count the demo first runs without ``--checkpoint`` (the reference digest).  Each
trial launches ``mpiexec -n N python -m mpi4py -m tensorplay_mpi.examples.train ...
--checkpoint DIR/...``, sends SIGTERM, SIGUSR1 or SIGINT to one rank process or to every one
at a random moment (of the whole run, or of its training), waits for the job to end, then
runs the same command again until it completes (at most twice).  Outcomes: ``resumed`` (it
stopped with status 75 and the rerun gave the reference digest), ``finished`` (it completed
first, with the reference digest), ``error`` (it failed, say killed by a signal before its
handlers were installed, and the rerun gave the reference digest), ``WRONG`` (anything else).
A job that outlives its timeout is a hang: WRONG.  Prints per rank count the outcomes, the
largest stop latency of a signal sent while it trained (signal to job end), and the
checkpoint sizes and write times the demo reported; exits 1 on any WRONG.
"""

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import time

from tensorplay_mpi.examples.train import STOPPED
from tensorplay_mpi.testing import mpiexec_path

DEMO = ["-m", "tensorplay_mpi.examples.train", "--epochs", "2", "--hidden", "16",
        "--min-accuracy", "0"]
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
TIMEOUT = 90


def launch(nprocs, args, demo=DEMO):
    return subprocess.Popen([mpiexec_path(), "-n", str(nprocs), sys.executable, "-m", "mpi4py",
                             *demo, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish(job):
    """(exit status, output); a job past the timeout is killed: status None."""
    try:
        out, _ = job.communicate(timeout=TIMEOUT)
        return job.returncode, out
    except subprocess.TimeoutExpired:
        job.kill()
        return None, job.communicate()[0]


def rank_processes(root):
    """The pids of the demo's rank processes below process `root` (from /proc)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            children.setdefault(ppid, []).append((int(entry), cmdline))
    found, todo = [], [root]
    while todo:
        for pid, cmdline in children.get(todo.pop(), []):
            if b"tensorplay_mpi.examples.train" in cmdline and b"mpiexec" not in cmdline:
                found.append(pid)
            else:
                todo.append(pid)
    return found


def digest_of(out):
    found = re.search(r"parameters identical on all \d+ ranks: yes \(digest ([0-9a-f]+)\)", out)
    return found.group(1) if found else None


def trial(nprocs, directory, reference, wall, training, rng, report):
    checkpoint = ["--checkpoint", directory]
    job = launch(nprocs, checkpoint)
    training_now = rng.random() < 0.5
    if not training_now:  # any moment, start-up included
        time.sleep(rng.uniform(0.2, wall))
    else:  # while it trains: from its first line, printed just before
        head = job.stdout.readline()
        while head and "training samples split" not in head:
            head = job.stdout.readline()
        time.sleep(rng.uniform(0, 1.2 * training))
    signum, one = rng.choice(SIGNALS), rng.random() < 0.5
    pids = rank_processes(job.pid)
    targets = [rng.choice(pids)] if one and pids else pids
    sent = time.perf_counter()
    for pid in targets:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    status, out = finish(job)
    latency = time.perf_counter() - sent
    written = re.search(r"written \((\d+) KiB in ([\d.]+) ms\)", out)
    if written:
        report["checkpoints"].append((int(written.group(1)), float(written.group(2))))
    if status == 0:
        verdict = "finished" if digest_of(out) == reference else "WRONG"
    elif status is None:
        verdict = "WRONG"
    else:
        if status == STOPPED and training_now:
            report["latency"] = max(report["latency"], latency)
        rerun, again = finish(launch(nprocs, checkpoint))
        ok = rerun == 0 and digest_of(again) == reference
        verdict = ("resumed" if status == STOPPED else "error") if ok else "WRONG"
        out += again
    report[verdict] += 1
    if verdict == "WRONG":
        print(f"  WRONG: {signal.Signals(signum).name} to {len(targets)} rank(s), exit "
              f"{status}:\n{out}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    wrong = 0
    for nprocs in options.ranks:
        rng = random.Random(options.seed * 100 + nprocs)
        start = time.perf_counter()
        status, out = finish(launch(nprocs, []))
        reference, wall = digest_of(out), time.perf_counter() - start
        training = float(re.search(r"training time ([\d.]+) s", out).group(1))
        if status != 0 or reference is None:
            print(f"the reference run failed at {nprocs} rank(s) (exit {status}):\n{out}")
            return 1
        report = {"resumed": 0, "finished": 0, "error": 0, "WRONG": 0, "latency": 0.0,
                  "checkpoints": []}
        for k in range(options.trials):
            trial(nprocs, os.path.join(options.dir, f"{nprocs}-{k}"), reference, wall, training,
                  rng, report)
        sizes = sorted({kib for kib, _ in report["checkpoints"]})
        times = [ms for _, ms in report["checkpoints"]]
        print(f"RESULT launched ranks={nprocs} "
              + " ".join(f"{k}={report[k]}" for k in ("resumed", "finished", "error", "WRONG"))
              + f" max_stop_latency_s={report['latency']:.2f} checkpoint_KiB={sizes} "
              f"write_ms={min(times, default=0):.1f}..{max(times, default=0):.1f} "
              f"(reference run {wall:.1f} s)", flush=True)
        wrong += report["WRONG"]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
