"""A collective that fails because a stop (scancel's SIGTERM) ended the other ranks first is one line in
the log, not a gloo traceback (issue 41.11); without a stop the traceback stays."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import torch
    import torch.distributed as dist
    import gpukit
    from gpukit.worker import install_preemption_handler

    install_preemption_handler()
    if sys.argv[1] != "running":
        os.kill(os.getpid(), signal.SIGTERM)  # as scancel does: the flag is set, the loop goes on
    try:
        dist.all_reduce(torch.zeros(1))  # raises inside torch.distributed (no group: the peers are gone)
    except Exception as exc:
        if sys.argv[1] != "wrapped":
            raise
        # as a checkpoint's exchange does: gpukit's error, raised from torch's
        raise gpukit.errors.CheckpointError("the checkpoint's exchange of results failed") from exc
""")


@pytest.mark.parametrize("mode", ["stopped", "wrapped", "running"])
def test_a_collective_failing_after_sigterm_is_one_line(tmp_path: Path, mode: str) -> None:
    stopped = mode != "running"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_ERROR_FILE", "WORLD_SIZE")}
    env["RANK"] = "1"
    proc = subprocess.run([sys.executable, "-m", "gpukit.worker._bootstrap", str(script),
                           mode], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 1
    if stopped:
        assert "Traceback" not in proc.stderr, proc.stderr
        assert "gpukit: rank 1: stopped by SIGTERM; a collective ended as the other ranks stopped (" in proc.stderr
    else:
        assert "Traceback" in proc.stderr and "stopped by" not in proc.stderr, proc.stderr
