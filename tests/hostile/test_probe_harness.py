"""The probe harness classifies a forked reader as it classifies a fresh interpreter.

test_hostile_checkpoints forks each probe from a process that imported torch and gpukit once
(``_zygote.py``); these runs show the outcomes that matter reach the test through the fork:
a traceback, a clean error from the library or the CLI, an unexpected exit, a planted pickle's
side effect, a hang killed at its timeout with what it started.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import psutil

import pytest

from _probe import Run, canary_pickle_payload, execute


def _printed_fine(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.stdout == "fine\n"


def _cases(tmp: Path) -> dict[str, tuple[Run, str]]:
    canary = tmp / "canary"
    (tmp / "plant.pkl").write_bytes(canary_pickle_payload(canary))
    return {
        "traceback": (Run("x", code="raise ValueError('boom')"), "traceback"),
        "library error": (Run("x", code="from gpukit.errors import CheckpointError\nraise CheckpointError('no')"),
                          "clean error"),
        "cli error": (Run("x", argv=["ckpt", "inspect", str(tmp / "missing")]), "clean error"),
        "exit 4": (Run("x", code="import sys\nsys.exit(4)"), "wrong"),
        "printed": (Run("x", code="print('fine')", check=_printed_fine), "correct"),
        "pickle": (Run("x", code=f"import pickle\npickle.loads(open({str(tmp / 'plant.pkl')!r}, 'rb').read())",
                       canary=canary), "code executed"),
        "hang": (Run("x", code="import subprocess, sys, time\n"
                              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                              "while True: time.sleep(1)", timeout_s=3), "hang"),
    }


@pytest.mark.parametrize("name", ["traceback", "library error", "cli error", "exit 4", "printed", "pickle", "hang"])
def test_a_forked_probe_is_classified_as_a_fresh_one(name: str, tmp_path: Path) -> None:
    run, expected = _cases(tmp_path)[name]
    result = execute(run, forked=True)
    assert result.outcome == expected, result.describe()
    if name == "hang":  # the process it started went with it
        assert not [p for p in psutil.process_iter(["cmdline"]) if "time.sleep(600)" in " ".join(p.info["cmdline"] or [])]


@pytest.mark.parametrize("name", ["cli error", "pickle"])
def test_the_same_probes_in_a_fresh_interpreter_agree(name: str, tmp_path: Path) -> None:
    run, expected = _cases(tmp_path)[name]
    assert execute(run).outcome == expected
