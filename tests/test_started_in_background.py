"""The suite passes however it was started: as a background job of a shell without job control
(``make test &`` in a script, a job runner) it inherits SIGINT *ignored*. The tests that stop
something with SIGINT set the disposition they need (the ``ctrl_c_as_from_a_terminal`` fixture);
this runs a few of them in a pytest that starts that way."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SIGINT_TESTS = [
    "cli/test_ls_cli.py::test_watch_refreshes_until_ctrl_c",
    "cli/test_cli_usability.py::test_ls_watch_piped_prints_one_table_after_another",
    "launch/test_launch_preemption.py::test_second_signal_falls_through_to_the_previous_handler",
]


def _ignore_sigint() -> None:  # what bash does for `cmd &` without job control
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_sigint_tests_pass_when_the_suite_starts_with_sigint_ignored() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "60",
         *(str(TESTS / t) for t in SIGINT_TESTS)],
        cwd=TESTS.parent, preexec_fn=_ignore_sigint, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "4 passed" in result.stdout, result.stdout[-2000:]  # ls --watch runs twice (json, rich)
