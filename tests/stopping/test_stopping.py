"""Stop requests of one process: the handlers only set a flag, and are restored afterwards."""

import os
import signal
import threading

import pytest

from tensorplay_mpi import clear_stop, request_stop, stop_on_signals, stop_requested


def test_a_signal_inside_the_block_is_a_request_and_the_handlers_come_back():
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    with stop_on_signals():
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop_requested() == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)  # the first request's reason is kept
        assert stop_requested() == "SIGUSR1"
    assert {s: signal.getsignal(s) for s in previous} == previous


def test_ctrl_c_twice_raises_keyboard_interrupt():
    before = signal.getsignal(signal.SIGINT)  # Python's, or SIG_IGN in a background job
    with pytest.raises(KeyboardInterrupt), stop_on_signals([signal.SIGINT]):
        os.kill(os.getpid(), signal.SIGINT)
        assert stop_requested() == "SIGINT"
        os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


def test_ctrl_c_after_another_stop_signal_raises_keyboard_interrupt():
    with pytest.raises(KeyboardInterrupt), stop_on_signals():
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGINT)


def test_a_reason_must_be_a_string():
    with pytest.raises(TypeError, match="reason must be a string"):
        request_stop(None)
    assert stop_requested() is None


def test_a_request_by_call_is_kept_until_cleared():
    assert stop_requested() is None
    request_stop("time limit near")
    request_stop("another")
    assert stop_requested() == "time limit near"
    clear_stop()
    assert stop_requested() is None


@pytest.mark.parametrize("signals, error", [(["SIGTERM"], TypeError), ([True], TypeError),
                                            ([signal.SIGKILL], OSError), ([99999], ValueError)])
def test_bad_signals_are_refused_and_nothing_stays_installed(signals, error):
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(error), stop_on_signals([signal.SIGTERM, *signals]):
        pass
    assert signal.getsignal(signal.SIGTERM) is before


def test_outside_the_main_thread_is_a_value_error():
    caught = []

    def enter():
        try:
            with stop_on_signals():
                pass
        except ValueError as error:
            caught.append(error)

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert caught and "main thread" in str(caught[0])
