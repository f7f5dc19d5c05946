"""The torch demo (AdamW, OneCycleLR, clipping through ``update=``) stopped by a real signal
and run again: the parameters, the optimizer's and the scheduler's state come back from the
checkpoint, and the run ends with the digest of a run never stopped."""

import functools
import re

import pytest
from helpers import STOP_DEMO, demo_digest

from tensorplay_mpi.examples.train import STOPPED
from tensorplay_mpi.testing import run_mpi

pytest.importorskip("torch")

DEMO = ["--epochs", "2", "--hidden", "16", "--min-accuracy", "0"]
TORCH_DEMO = ["-m", "tensorplay_mpi.examples.train_torch"]


@functools.cache
def reference(nprocs):
    return demo_digest(run_mpi(nprocs, [*TORCH_DEMO, *DEMO], timeout=120))


@pytest.mark.slow  # the NumPy demo's case at 2 ranks stays in make test
@pytest.mark.parametrize("nprocs, signal, ranks, batch, where", [
    # a signal in batch B's forward pass rides in heartbeat B + 1: B + 1 batches done
    (1, "SIGTERM", "all", 100, r"epoch 2, step 101 \(batches done by rank: \[11\]\)"),
    (2, "SIGUSR1", "all", 20, r"epoch 1, step 21 \(batches done by rank: \[21, 21\]\)"),
    (3, "SIGTERM", "2", 40, r"epoch 1, step 41 \(batches done by rank: \[15, 30, 41\]\)"),
], ids=["1-sigterm-epoch2", "2-sigusr1-all", "3-sigterm-one-rank-mid-epoch-uneven"])
def test_a_stopped_torch_demo_resumes_to_the_digest_of_a_run_never_stopped(
        tmp_path, nprocs, signal, ranks, batch, where):
    args = [*DEMO, "--checkpoint", str(tmp_path)]
    stopped = run_mpi(nprocs, [STOP_DEMO, "train_torch", signal, ranks, str(batch), *args],
                      timeout=120)
    assert stopped.returncode == STOPPED, f"{stopped.stdout}\n{stopped.stderr}"
    at = where.split(r" \(")[0]
    assert re.search(rf"stopped by .* at {at};", stopped.stdout), stopped.stdout
    resumed = run_mpi(nprocs, [*TORCH_DEMO, *args], timeout=120)
    assert re.search(rf"resumed from {tmp_path}/checkpoint.npz: {where}", resumed.stdout), \
        resumed.stdout
    assert demo_digest(resumed) == reference(nprocs)
