"""Jobs that lost a rank end by themselves, with the exit status their survivors chose.

    python tests/programs/elastic_exit_trials.py LOOP_TRIALS DEMO_TRIALS [BOUND_S]

LOOP_TRIALS runs of ``elastic_exit.py`` at 3 ranks, going through every victim (0, 1, 2),
``before`` and ``after`` the collective, exit status 0 and 3, and an exit with Python
finalizing MPI or after an explicit ``MPI.Finalize()``; then DEMO_TRIALS runs of the demo
under ``--elastic`` at 3 ranks, one of its rank processes SIGKILLed from outside at a random
moment, as ``elastic_demo_trials.py`` does.  A trial passes when every survivor printed its
results (``RESULT ... ok``; the demo's lines), the launcher exited with the status the
survivors chose (the demo: 0), and the job ended within BOUND_S seconds (default 30) of its
last line of output: a job still running then is killed and counted as a hang, whether its
ranks or only the launcher are left.  Prints one line per trial (the seconds from the kill and
from the last line to the launcher's exit), then ``TRIALS loop=OK/N demo=OK/N hangs=H
slowest exit=S s`` and exits 1 if any trial failed.
"""

import itertools
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from elastic_demo_trials import DEMO, OMPI, rank_pids  # noqa: E402

LOOP = [*OMPI, "-n", "3", ".venv-ompi/bin/python", "tests/programs/elastic_exit.py"]
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
START_S = 180  # the launch and the run before the kill, on a loaded machine


class Job:
    """A launch whose output lines are read, with their arrival times, by a thread."""

    def __init__(self, command):
        self.process = subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line))

    def wait_for(self, pattern, timeout):
        """The time of the first line matching `pattern`, or None after `timeout` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, line in list(self.lines):
                if re.search(pattern, line):
                    return at
            if self.process.poll() is not None and not self.reader.is_alive():
                return None
            time.sleep(0.02)
        return None

    def end(self, bound):
        """(exit status or "HANG", the time it ended): the job must end within `bound` s of
        its last line; else its process group is killed."""
        while self.process.poll() is None:
            last = self.lines[-1][0] if self.lines else time.monotonic()
            if time.monotonic() - last > bound:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
                self.reader.join()
                return "HANG", time.monotonic()
            time.sleep(0.05)
        ended = time.monotonic()
        self.reader.join()
        return self.process.returncode, ended

    @property
    def text(self):
        return "".join(line for _, line in self.lines)


def loop_trial(victim, when, status, how, bound):
    job = Job([*LOOP, str(victim), when, str(status), how])
    killed = job.wait_for(r"^KILLED", START_S)
    code, ended = job.end(bound)
    oks = sum(line.startswith("RESULT") and " ok" in line for _, line in job.lines)
    ok = killed is not None and oks == 2 and code == status
    return ok, code, killed, ended, job


def demo_trial(rng, bound):
    job = Job([*OMPI, "-n", "3", *DEMO])
    killed = None
    if job.wait_for("ranks,", START_S) is not None:
        time.sleep(rng.uniform(0, 0.6))
        pids = rank_pids(job.process.pid)
        if pids:
            os.kill(rng.choice(pids), signal.SIGKILL)
            killed = time.monotonic()
    code, ended = job.end(bound)
    text = job.text
    if "lost rank(s)" not in text and "held-out accuracy" in text:
        return None, code, killed, ended, job  # the kill came after training: drawn again
    ok = (killed is not None and code == 0 and "each exactly once: yes" in text
          and "parameters identical on all 2 ranks: yes" in text)
    return ok, code, killed, ended, job


def main():
    loops, demos = int(sys.argv[1]), int(sys.argv[2])
    bound = float(sys.argv[3]) if len(sys.argv) > 3 else 30.0
    cases = itertools.cycle([  # each 6 in a row: every victim, before and after
        (victim, when, status, how)
        for status, how in ((0, "atexit"), (3, "explicit"), (3, "atexit"), (0, "explicit"))
        for victim, when in itertools.product((0, 1, 2), ("before", "after"))])
    rng = random.Random(int(time.time()))
    counts = {"loop": [0, 0], "demo": [0, 0]}
    hangs, slowest = 0, 0.0
    while counts["loop"][1] + counts["demo"][1] < loops + demos:
        if counts["loop"][1] < loops:
            kind, args = "loop", next(cases)
            ok, code, killed, ended, job = loop_trial(*args, bound)
        else:
            kind, args = "demo", ()
            ok, code, killed, ended, job = demo_trial(rng, bound)
            if ok is None:
                continue
        last = job.lines[-1][0] if job.lines else ended
        exit_s = ended - last
        counts[kind][0] += ok
        counts[kind][1] += 1
        hangs += code == "HANG"
        slowest = max(slowest, exit_s)
        since_kill = f"{ended - killed:5.1f} s after the kill" if killed else "no kill"
        print(f"{kind} {' '.join(map(str, args)):22} {'ok' if ok else 'FAIL'} exit {code}, "
              f"ended {since_kill}, {exit_s:4.1f} s after its last line", flush=True)
        if not ok:
            print(re.sub(r"\[[#.]+\] epoch +\d+/\d+ [^\n\[]*", "", job.text)[-3000:],
                  flush=True)
    print(f"TRIALS loop={counts['loop'][0]}/{counts['loop'][1]} "
          f"demo={counts['demo'][0]}/{counts['demo'][1]} hangs={hangs} "
          f"slowest exit={slowest:.1f} s", flush=True)
    ok = counts["loop"][0] + counts["demo"][0]
    return 0 if ok == counts["loop"][1] + counts["demo"][1] else 1


if __name__ == "__main__":
    sys.exit(main())
