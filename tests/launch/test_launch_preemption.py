"""SIGTERM in a worker sets the stop flag instead of killing it; a second one kills."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from gpukit.launch import (
    install_preemption_handler,
    stop_requested,
    uninstall_preemption_handler,
)

pytestmark = pytest.mark.usefixtures("clean_stop_flag")

def _wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)

def test_sigterm_sets_the_flag_and_uninstall_restores_the_old_handler():
    before = signal.getsignal(signal.SIGTERM)
    assert install_preemption_handler() is True
    assert not stop_requested()
    os.kill(os.getpid(), signal.SIGTERM)
    _wait_for(stop_requested)
    uninstall_preemption_handler()
    assert signal.getsignal(signal.SIGTERM) == before

@pytest.mark.usefixtures("ctrl_c_as_from_a_terminal")  # the previous handler: Python's own
def test_second_signal_falls_through_to_the_previous_handler():
    install_preemption_handler()
    os.kill(os.getpid(), signal.SIGINT)
    _wait_for(stop_requested)
    with pytest.raises(KeyboardInterrupt):  # Python's default SIGINT handler, as before
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # the handler runs between bytecodes; the raise ends this wait

def test_second_sigterm_kills_a_process_that_ignores_the_flag():
    code = (
        "import sys, time; from gpukit.launch import install_preemption_handler, stop_requested\n"
        "install_preemption_handler(); print('ready', flush=True)\n"
        "while not stop_requested(): time.sleep(0.01)\n"
        "print('flag', flush=True)\n"
        "while True: time.sleep(0.01)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().strip() == "flag"
        assert proc.poll() is None  # still alive after the first SIGTERM
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
