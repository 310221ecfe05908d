"""slurm_cluster.sh's /etc/hosts lines: clusters side by side each add and remove only their own
(the script runs for real, on a hosts file of the test's own: GPUKIT_SLURM_HOSTS_FILE)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from slurm_helpers import SCRIPT


def _hosts(action: str, directory: Path, hosts: Path) -> None:
    subprocess.run(["bash", str(SCRIPT), action, str(directory)], check=True, timeout=30,
                   env={**os.environ, "GPUKIT_SLURM_HOSTS_FILE": str(hosts)})


def _names(hosts: Path, directory: Path) -> list[str]:
    return [line.split()[1] for line in hosts.read_text().splitlines() if line.endswith(f" {directory}")]


def test_two_clusters_keep_their_own_host_lines(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n10.0.0.9 other # gpukit-test-slurm-like but not ours\n")
    first, second = tmp_path / "a", tmp_path / "a-b"  # one DIR a prefix of the other
    _hosts("map-hosts", first, hosts)
    _hosts("map-hosts", second, hosts)
    _hosts("map-hosts", second, hosts)  # a second start of the same cluster adds nothing
    assert _names(hosts, first) == ["node1", "node2"]
    assert _names(hosts, second) == ["node1", "node2"]
    _hosts("unmap-hosts", first, hosts)  # the first cluster stops: the second keeps its names
    assert _names(hosts, first) == []
    assert _names(hosts, second) == ["node1", "node2"]
    _hosts("unmap-hosts", second, hosts)
    assert hosts.read_text() == "127.0.0.1 localhost\n10.0.0.9 other # gpukit-test-slurm-like but not ours\n"
