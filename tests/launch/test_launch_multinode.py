"""Multi-node for real: two network namespaces joined by a veth pair, one `gpukit run
--nnodes 2` in each, and the 2-node DDP result equals the 1-node 2-process result.

Only private addresses inside the two namespaces are used; nothing leaves this machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid

import pytest
from launch_helpers import BEHAVE, assert_none_survive

pytestmark = pytest.mark.slow


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_namespaces():
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    if os.geteuid() != 0:
        pytest.skip("making network namespaces needs root")
    tag = uuid.uuid4().hex[:6]
    names = (f"gk{tag}a", f"gk{tag}b")
    links = (f"gkv{tag}a", f"gkv{tag}b")
    addrs = ("10.231.77.1", "10.231.77.2")
    made: list[str] = []
    try:
        for ns in names:
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for ns, link, addr in zip(names, links, addrs):
            _ip("link", "set", link, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as exc:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        reason = getattr(exc, "stderr", None) or str(exc)
        pytest.skip(f"cannot make network namespaces here: {reason.strip()}")
    try:
        yield list(zip(names, links, addrs))
    finally:
        for ns in names:  # deleting a namespace also deletes the veth pair in it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_two_node_ddp_matches_one_node(two_namespaces, start_run, tmp_path):
    master = two_namespaces[0][2]
    shared_out = tmp_path / "two-node"
    shared_out.mkdir()
    nodes = []
    for rank, (ns, link, _addr) in enumerate(two_namespaces):
        nodes.append(start_run(
            "--nnodes", "2", "--node-rank", str(rank), "--master-addr", master, "--master-port", "29531",
            "--rdzv-timeout", "60", "--cpu", "--nproc", "1", str(BEHAVE), "ddp", "{out}",
            prefix=("ip", "netns", "exec", ns), out=shared_out,
            env={"GLOO_SOCKET_IFNAME": link},  # gloo would otherwise pick the host's hostname address
        ))
    single = start_run("--cpu", "--nproc", "2", str(BEHAVE), "ddp", "{out}")

    for node in nodes:
        assert node.wait(timeout_s=120) == 0, node.output()
    assert single.wait(timeout_s=120) == 0, single.output()
    assert "node 0 of 2" in nodes[0].output()
    two_node = json.loads((shared_out / "ddp.json").read_text())
    one_node = json.loads((single.out / "ddp.json").read_text())
    assert two_node["world"] == one_node["world"] == 2
    for got, want in zip(two_node["params"], one_node["params"]):
        assert got == pytest.approx(want, abs=1e-6)
    for run in (*nodes, single):
        assert_none_survive(run.marker)
