"""A script read from standard input (``python -``) launches its workers by fork, as a notebook does:
a spawned worker cannot import ``<stdin>`` (issue 41.12)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch
    import gpukit

    def train(session):
        t = session.all_reduce(torch.tensor(float(session.rank)), "sum")
        return (session.rank, session.world_size, float(t))

    session = gpukit.Session(accelerator="cpu", devices=2, verbose=False)
    print("RESULTS", session.launch(train))
""")


def test_a_script_on_stdin_launches_two_workers() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-"], input=SCRIPT, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "RESULTS [(0, 2, 1.0), (1, 2, 1.0)]" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "FileNotFoundError" not in proc.stderr
