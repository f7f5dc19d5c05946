"""The demo stopped by a real signal and run again: the digest of a run never stopped."""

import functools
import re

import pytest
from helpers import STOP_DEMO, demo_digest

from tensorplay_mpi.examples.train import STOPPED
from tensorplay_mpi.testing import run_mpi

DEMO = ["--epochs", "2", "--hidden", "16", "--min-accuracy", "0"]


@functools.cache
def reference(nprocs):
    return demo_digest(run_mpi(nprocs, ["-m", "tensorplay_mpi.examples.train", *DEMO], timeout=120))


@pytest.mark.parametrize("nprocs, signal, ranks, batch, where", [
    # a signal in batch B's backward pass rides in heartbeat B + 1: B + 1 batches done;
    # the case at 2 ranks stays in make test, the others are slow (~15 s each)
    pytest.param(1, "SIGTERM", "all", 100, r"epoch 2, step 101 \(batches done by rank: \[11\]\)",
                 marks=pytest.mark.slow),
    (2, "SIGUSR1", "all", 20, r"epoch 1, step 21 \(batches done by rank: \[21, 21\]\)"),
    pytest.param(3, "SIGTERM", "2", 40,
                 r"epoch 1, step 41 \(batches done by rank: \[15, 30, 41\]\)",
                 marks=pytest.mark.slow),
    pytest.param(4, "SIGINT", "0", 5, r"epoch 1, step 6 \(batches done by rank: \[6, 6, 6, 6\]\)",
                 marks=pytest.mark.slow),
], ids=["1-sigterm-epoch2", "2-sigusr1-all", "3-sigterm-one-rank-mid-epoch-uneven",
        "4-sigint-rank0"])
def test_a_stopped_demo_resumes_to_the_digest_of_a_run_never_stopped(tmp_path, nprocs, signal,
                                                                      ranks, batch, where):
    args = [*DEMO, "--checkpoint", str(tmp_path)]
    stopped = run_mpi(nprocs, [STOP_DEMO, "train", signal, ranks, str(batch), *args], timeout=120)
    assert stopped.returncode == STOPPED, f"{stopped.stdout}\n{stopped.stderr}"
    reason = signal if ranks in ("all", "0") else r"a stop requested by 1 other rank\(s\)"
    at = where.split(r" \(")[0]  # rank 0 prints why: its own signal, or another rank's
    assert re.search(rf"stopped by {reason} at {at};", stopped.stdout), stopped.stdout
    assert "Abort" not in stopped.stderr  # a clean exit with the status, no MPI_Abort
    resumed = run_mpi(nprocs, ["-m", "tensorplay_mpi.examples.train", *args], timeout=120)
    assert re.search(rf"resumed from {tmp_path}/checkpoint.npz: {where}", resumed.stdout), \
        resumed.stdout
    assert demo_digest(resumed) == reference(nprocs)
    if nprocs == 2:  # once more: a completed run only reports
        again = run_mpi(nprocs, ["-m", "tensorplay_mpi.examples.train", *args], timeout=120)
        assert "training was complete" in again.stdout and demo_digest(again) == reference(nprocs)
