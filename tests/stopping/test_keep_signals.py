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


AT_EXIT = """
import atexit, signal
def after_the_library_s_hook():  # registered first: runs after the library's exit hook
    print("at exit", {names}, flush=True)
atexit.register(after_the_library_s_hook)
from tensorplay_mpi import keep_stop_signals
keep_stop_signals()
"""


def test_kept_signals_are_ignored_at_exit_so_a_signal_during_mpi_finalize_cannot_kill_a_job():
    """Python gives its handlers their default action back before mpi4py finalizes MPI: the
    library's exit hook ignores the kept signals first (SIGINT's default stays Python's)."""
    names = "[signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGTERM, signal.SIGUSR1, " \
            "signal.SIGINT)]"
    result = subprocess.run([sys.executable, "-c", AT_EXIT.format(names=names)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "at exit [True, True, True]" in result.stdout, result.stdout
