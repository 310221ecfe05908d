"""A real 2-node SLURM cluster for the tests in this folder (started once per session).

``slurm_cluster.sh start`` installs Debian's slurm packages when missing, configures node1 and
node2 on 127.0.0.1 and waits until both are idle; where that cannot happen (not root, no
apt-get, no network, daemons that do not start) the tests skip and say why.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from slurm_helpers import SCRIPT, SlurmCluster

INSTALL_AND_START_TIMEOUT_S = 600


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    directory = tmp_path_factory.mktemp("slurm")
    started = time.monotonic()
    try:
        result = subprocess.run([str(SCRIPT), "start", str(directory)], capture_output=True, text=True,
                                timeout=INSTALL_AND_START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        subprocess.run([str(SCRIPT), "stop", str(directory)], capture_output=True, timeout=60)
        pytest.skip(f"SLURM cluster did not start within {INSTALL_AND_START_TIMEOUT_S} s")
    if result.returncode != 0:
        subprocess.run([str(SCRIPT), "stop", str(directory)], capture_output=True, timeout=60)
        reason = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"exit {result.returncode}"
        print(f"\nSLURM tests skipped: {reason}", file=sys.stderr)
        pytest.skip(f"no SLURM cluster: {reason}")
    print(f"\nSLURM cluster up in {time.monotonic() - started:.1f} s ({directory})", file=sys.stderr)
    env = {**os.environ, "SLURM_CONF": str(directory / "slurm.conf")}
    for key in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        del env[key]  # a test suite run inside a SLURM job must not leak that job's identity
    try:
        yield SlurmCluster(directory, env)
    finally:
        subprocess.run([str(SCRIPT), "stop", str(directory)], capture_output=True, timeout=120)
