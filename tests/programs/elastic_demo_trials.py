"""SIGKILL a random rank of the demo at a random moment, under Open MPI's ULFM (``--elastic``).

    python tests/programs/elastic_demo_trials.py TRIALS [RANKS]

Each trial launches ``examples.train --elastic`` at RANKS ranks (default 3), waits for its
first line, sleeps a random 0-0.6 s and SIGKILLs one of its rank processes, drawn at random
(rank 0 included).  A trial passes when the job exits 0 on the survivors and prints the lost
rank's line, the epoch of the loss with "each exactly once: yes", the held-out accuracy and
"parameters identical on all RANKS-1 ranks: yes".  A kill that lands after training (the
job had already printed its accuracy) is drawn again.  Prints one line per trial and a table.
"""

import os
import random
import re
import signal
import subprocess
import sys
import time

OMPI = [".venv-ompi/bin/mpiexec", "--oversubscribe", "--with-ft", "ulfm"]
DEMO = [".venv-ompi/bin/python", "-m", "tensorplay_mpi.examples.train", "--epochs", "40",
        "--elastic"]
TIMEOUT_S = 60


def rank_pids(launcher):
    """The rank processes of the job: python processes below the launcher."""
    out = subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
    children, rows = {}, [line.split(None, 2) for line in out.splitlines()[1:]]
    for pid, ppid, args in rows:
        children.setdefault(int(ppid), []).append((int(pid), args))
    found, todo = [], [launcher]
    while todo:
        for pid, args in children.get(todo.pop(), []):
            todo.append(pid)
            if "tensorplay_mpi.examples.train" in args and "python" in args.split()[0]:
                found.append(pid)
    return found


def trial(ranks, rng):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    job = subprocess.Popen([*OMPI, "-n", str(ranks), *DEMO], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    lines = [job.stdout.readline()]
    while "ranks," not in lines[-1] and lines[-1]:
        lines.append(job.stdout.readline())
    pause = rng.uniform(0, 0.6)
    time.sleep(pause)
    pids = rank_pids(job.pid)
    victim = rng.choice(pids) if pids else None
    if victim is not None:
        os.kill(victim, signal.SIGKILL)
    start = time.monotonic()
    try:
        rest, _ = job.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        left = subprocess.run(["ps", "-o", "pid,stat,wchan:20,args", "--ppid",
                               " ".join(str(p) for p in [job.pid, *rank_pids(job.pid)])],
                              capture_output=True, text=True).stdout
        os.killpg(job.pid, signal.SIGKILL)
        rest, _ = job.communicate()
        return "HANG", pause, f"{''.join(lines)}{rest}\nleft running:\n{left}"
    text = "".join(lines) + rest
    if "lost rank(s)" not in text and "held-out accuracy" in text:
        return "late", pause, text
    checks = {"exit 0": job.returncode == 0,
              "the lost rank's line": re.search(r"lost rank\(s\) \[\d\]", text) is not None,
              "each exactly once": "each exactly once: yes" in text,
              "the accuracy": "held-out accuracy" in text,
              "identical": f"parameters identical on all {ranks - 1} ranks: yes" in text}
    failed = [name for name, ok in checks.items() if not ok]
    return ("WRONG" if failed else "ok", pause,
            f"missing: {failed}; exit {job.returncode} in {time.monotonic() - start:.1f} s\n"
            f"{text}")


def main():
    trials = int(sys.argv[1])
    ranks = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    rng = random.Random(int(time.time()))
    results = []
    while len(results) < trials:
        verdict, pause, text = trial(ranks, rng)
        if verdict == "late":
            continue
        lost = re.search(r"lost rank\(s\) \[(\d)\] of \d at epoch (\d+), step (\d+)", text)
        accuracy = re.search(r"held-out accuracy ([\d.]+)", text)
        results.append(verdict)
        print(f"trial {len(results)}: {verdict}  kill after {pause:.2f} s  "
              f"lost rank {lost.group(1) if lost else '?'} at epoch "
              f"{lost.group(2) if lost else '?'}, step {lost.group(3) if lost else '?'}  "
              f"accuracy {accuracy.group(1) if accuracy else '?'}", flush=True)
        if verdict != "ok":  # without the progress bars
            print(re.sub(r"\[[#.]+\] epoch +\d+/\d+ [^\n\[]*", "", text)[-3000:], flush=True)
    print(f"TRIALS ranks={ranks} ok={results.count('ok')} of {len(results)}", flush=True)
    return 0 if results.count("ok") == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
