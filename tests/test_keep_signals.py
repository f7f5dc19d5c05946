"""keep_stop_signals(): a signal after a stop_on_signals() block, or during the set-up or the
final save, sets a stop request instead of killing the program."""

import signal
import subprocess
import sys

import pytest

from tensorplay_mpi import keep_stop_signals

PROGRAM = """
import os, signal, sys, time
from tensorplay_mpi import keep_stop_signals, stop_on_signals, stop_requested
if sys.argv[1] == "keep":
    keep_stop_signals()
with stop_on_signals():
    pass  # the training loop
os.kill(os.getpid(), signal.{name})  # during the final save, after the block
time.sleep(0.2)
print("survived", stop_requested(), flush=True)
"""


@pytest.mark.parametrize("name", ["SIGUSR1", "SIGTERM"])
def test_a_signal_after_the_block_only_sets_a_request_under_keep_stop_signals(name):
    program = PROGRAM.format(name=name)
    kept = subprocess.run([sys.executable, "-c", program, "keep"], capture_output=True,
                          text=True, timeout=60)
    assert kept.returncode == 0 and f"survived {name}" in kept.stdout, kept.stderr
    plain = subprocess.run([sys.executable, "-c", program, "plain"], capture_output=True,
                           text=True, timeout=60)
    assert plain.returncode == -getattr(signal, name), (plain.returncode, plain.stdout)


def test_keep_stop_signals_checks_its_signals():
    with pytest.raises(TypeError, match=r"keep_stop_signals takes signal numbers .* str 'TERM'"):
        keep_stop_signals(["TERM"])
