"""kill -9 trials of the demo with periodic checkpoints, and resumes at another world size
(``make stop-trials``).

    python tests/programs/kill_trials.py --ranks 1 2 3 4 --trials 5 --resize 2:3 3:2 4:2 --dir D

For each rank count N the demo first runs without ``--checkpoint`` (the reference digest).  Each
trial launches ``mpiexec -n N python -m mpi4py -m tensorplay_mpi.examples.train ...
--checkpoint DIR --save-every STEPS``, SIGKILLs every rank process at a random moment of the
run (no signal handler runs: as a node failure or an OOM kill), then runs the same command
until it completes.  Outcomes: ``resumed`` (the rerun resumed from a periodic checkpoint and
ended with the reference digest), ``fresh`` (killed before the first save: the rerun started
over, reference digest), ``finished`` (the run completed before the kill), ``WRONG`` (another
digest, a failed rerun or a hang).

``--device cuda`` runs them on GPUs.  ``--demo torch --norm batch`` (or ``sync``) runs the trials
on the torch demo (``examples.train_torch``) with a BatchNorm (or SyncBatchNorm) layer, whose
digest covers the running statistics: a periodic save while a rank has joined must hold the
active ranks' buffers.  It has no resize trials (the torch demo resumes at the same world size).

Each ``--resize N:M`` trial stops the demo at N ranks with SIGUSR1 while it trains and resumes
it at M ranks: the rerun must complete and, when the stop came mid-epoch, print that the
resumed epoch used every sample exactly once.  Prints ``RESULT ...`` lines; exits 1 on any
WRONG.
"""

import argparse
import os
import random
import re
import signal
import sys
import time

from stop_launches import DEMO, digest_of, finish, launch, rank_processes

from tensorplay_mpi.examples.train import STOPPED

SAVE_EVERY = 5
TORCH_DEMO = ["-m", "tensorplay_mpi.examples.train_torch", *DEMO[2:]]


def training_started(job):
    """Read `job`'s output up to its first line, printed just before it trains."""
    head = job.stdout.readline()
    while head and "training samples split" not in head:
        head = job.stdout.readline()
    return head


def signal_ranks(job, signum):
    for pid in rank_processes(job.pid):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def kill_all(job, rng, wall, training):
    """SIGKILL every rank of `job` at a random moment: half the trials while it trains, half
    at any moment of the run (start-up included)."""
    if rng.random() < 0.5:
        head = training_started(job)
        time.sleep(rng.uniform(0, 1.1 * training))
    else:
        head = ""
        time.sleep(rng.uniform(0.2, 0.9 * wall))
    signal_ranks(job, signal.SIGKILL)
    status, out = finish(job)
    return status, head + out


def kill_trial(nprocs, directory, reference, wall, training, rng, report, demo):
    args = ["--checkpoint", directory, "--save-every", str(SAVE_EVERY)]
    status, out = kill_all(launch(nprocs, args, demo), rng, wall, training)
    if status == 0:
        verdict = "finished" if digest_of(out) == reference else "WRONG"
    else:
        rerun, again = finish(launch(nprocs, args, demo))
        ok = rerun == 0 and digest_of(again) == reference
        verdict = ("resumed" if "resumed from" in again else "fresh") if ok else "WRONG"
        out += again
    report[verdict] += 1
    if verdict == "WRONG":
        print(f"  WRONG kill trial at {nprocs} rank(s), exit {status}:\n{out}", flush=True)


def resize_trial(before, after, directory, training, rng, report):
    args = ["--checkpoint", directory]
    job = launch(before, args)
    training_started(job)
    time.sleep(rng.uniform(0, 0.8 * training))
    signal_ranks(job, signal.SIGUSR1)
    status, out = finish(job)
    if status != STOPPED:
        report["finished" if status == 0 else "WRONG"] += 1
        if status != 0:
            print(f"  WRONG resize {before}->{after}: the stopped run exited {status}:\n{out}",
                  flush=True)
        return
    rerun, again = finish(launch(after, args))
    mid_epoch = "re-split" in again and "training was complete" not in again
    once = re.search(r"each exactly once: (\S+)", again)
    ok = rerun == 0 and (not mid_epoch or (once is not None and once.group(1) == "yes"))
    report["resumed" if ok else "WRONG"] += 1
    if not ok:
        print(f"  WRONG resize {before}->{after}:\n{out}{again}", flush=True)
    elif once:
        report["checked"] += 1


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, nargs="*", default=[1, 2, 3, 4])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--resize", nargs="*", default=["2:3", "3:2", "4:2"])
    parser.add_argument("--resize-trials", type=int, default=2)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--demo", choices=["numpy", "torch"], default="numpy")
    parser.add_argument("--norm", choices=["batch", "sync", "none"], default="batch",
                        help="with --demo torch: the model's normalisation layer")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="the demo's --device (cuda: torch CUDA tensors or CuPy arrays)")
    options = parser.parse_args()
    demo = DEMO if options.demo == "numpy" else [*TORCH_DEMO, "--norm", options.norm]
    demo = [*demo, "--device", options.device]
    if options.demo == "torch":
        options.resize = []
    wrong, references = 0, {}
    for nprocs in sorted(set(options.ranks) | {int(p.split(":")[0]) for p in options.resize}):
        start = time.perf_counter()
        status, out = finish(launch(nprocs, [], demo))
        if status != 0 or digest_of(out) is None:
            print(f"the reference run failed at {nprocs} rank(s) (exit {status}):\n{out}")
            return 1
        training = float(re.search(r"training time ([\d.]+) s", out).group(1))
        references[nprocs] = (digest_of(out), time.perf_counter() - start, training)
    for nprocs in options.ranks:
        rng = random.Random(options.seed * 100 + nprocs)
        reference, wall, training = references[nprocs]
        report = dict.fromkeys(("resumed", "fresh", "finished", "WRONG"), 0)
        for k in range(options.trials):
            kill_trial(nprocs, os.path.join(options.dir, f"kill-{nprocs}-{k}"), reference, wall,
                       training, rng, report, demo)
        name = "numpy demo" if demo is DEMO else f"torch demo --norm {options.norm}"
        print(f"RESULT kill-9 {name} ranks={nprocs} "
              + " ".join(f"{k}={v}" for k, v in report.items())
              + f" (save every {SAVE_EVERY} steps; reference run {wall:.1f} s)", flush=True)
        wrong += report["WRONG"]
    for pair in options.resize:
        before, after = (int(n) for n in pair.split(":"))
        rng = random.Random(options.seed * 100 + 10 * before + after)
        report = dict.fromkeys(("resumed", "finished", "WRONG", "checked"), 0)
        for k in range(options.resize_trials):
            resize_trial(before, after, os.path.join(options.dir, f"resize-{pair}-{k}"),
                         references[before][2], rng, report)
        print(f"RESULT resize {before}->{after} " + " ".join(f"{k}={v}" for k, v in
                                                            report.items())
              + " (checked: the resumed epoch printed every sample exactly once)", flush=True)
        wrong += report["WRONG"]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
