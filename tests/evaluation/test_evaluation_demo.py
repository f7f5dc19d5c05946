"""The demos validate each epoch on an uneven split of the held-out set, each sample once.

The last epoch's validation accuracy must be the held-out accuracy the demo computes on one
process over the whole held-out set (its ``held-out accuracy`` line, plain NumPy or torch).
"""

import re

import pytest

from tensorplay_mpi.testing import run_mpi


@pytest.mark.parametrize("demo", ["train", pytest.param("train_torch", marks=pytest.mark.slow)])
def test_validation_counts_every_sample_once_and_equals_one_process(demo):
    pytest.importorskip("sklearn")
    if demo == "train_torch":
        pytest.importorskip("torch")
    result = run_mpi(3, ["-m", f"tensorplay_mpi.examples.{demo}", "--epochs", "2",
                         "--min-accuracy", "0"], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = re.findall(r"validation accuracy ([\d.]+) loss ([\d.]+) \((\d+)/(\d+) samples\)",
                       result.stdout)
    held_out = re.search(r"held-out accuracy ([\d.]+) \((\d+) samples\)", result.stdout)
    assert len(lines) == 2 and held_out is not None
    assert all(counted == total == held_out.group(2) for _, _, counted, total in lines)
    assert lines[-1][0] == held_out.group(1)
