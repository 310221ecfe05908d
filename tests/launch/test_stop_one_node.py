"""A stop that reaches one node only (SLURM delivers its warning to each node's step separately, and may
drop one): the other node's ranks stop with it through the Session's agreement, and both launchers end
at once -- node 1 reports its stop instead of waiting in torch's exit barrier for node 0, which, stopped
by its signal, never enters it (before: node 0 waited --grace + 60 s for node 1's report, issue 41)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch_helpers import SCRIPTS, poll

from gpukit.launch import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.slow


def _node(node_rank: int, port: int, out: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["GLOO_SOCKET_IFNAME"] = "lo"  # both "nodes" are this machine
    cmd = [sys.executable, "-m", "gpukit", "run", "--cpu", "--nproc", "1", "--nnodes", "2", "--node-rank",
           str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port), "--grace", "5",
           str(SCRIPTS / "session_stop.py"), str(out)]
    log = (out / f"node{node_rank}.log").open("w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def test_a_warning_to_one_node_stops_both_at_once(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = [_node(0, port, tmp_path), _node(1, port, tmp_path)]
    logs = lambda: "\n".join((tmp_path / f"node{n}.log").read_text()[-2000:] for n in (0, 1))  # noqa: E731
    try:
        poll(lambda: all((tmp_path / f"pid-{r}").exists() for r in (0, 1)), 120, "both ranks training\n" + logs())
        sent = time.monotonic()
        nodes[0].send_signal(signal.SIGUSR2)  # node 0's launcher only; it passes it to its own worker
        codes = [node.wait(timeout=120) for node in nodes]
        took = time.monotonic() - sent
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert codes == [PREEMPTED_EXIT_CODE, PREEMPTED_EXIT_CODE], logs()
    assert all((tmp_path / f"stopped-{r}").exists() for r in (0, 1))  # both ranks left their loop
    assert took < 30, f"{took:.1f} s from the warning to both launchers' end (--grace 5 + 60 before)\n{logs()}"
