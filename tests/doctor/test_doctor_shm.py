"""/dev/shm against what DataLoader workers need: a real tiny tmpfs, and a path argument."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Callable, Iterator

import pytest

from gpukit._util.cpu import auto_worker_count, usable_cpu_count
from gpukit.doctor import run_checks
from gpukit.doctor._shm import check_shm, shm_needed_bytes

MIB = 1024**2


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """Mount tmpfs filesystems of a given size (root only; skipped otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; the path-argument tests cover the logic")
    mounted: list[Path] = []

    def mount(size_mib: int) -> Path:
        target = tmp_path / f"shm{len(mounted)}"
        target.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(target)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        subprocess.run(["umount", str(target)], check=False)


def _needed() -> int:
    return shm_needed_bytes(auto_worker_count(usable_cpu_count(), 1))


def _shm(result) -> object:
    [finding] = [f for f in result.findings if f.name == "system.shm"]
    return finding


def test_tiny_tmpfs_fails_with_the_docker_fix(tmpfs):
    path = tmpfs(1)
    finding = _shm(run_checks(shm_path=path))
    assert finding.status == "fail"
    assert "1.00 MiB" in finding.message and "Bus error" in finding.message
    assert "--shm-size" in finding.fix and "--ipc=host" in finding.fix


def test_big_enough_but_full_tmpfs_warns(tmpfs, make_ctx):
    needed = _needed()
    path = tmpfs(2 * needed // MIB + 2)
    with open(path / "torch_leftover", "wb") as fh:  # a segment a killed run left behind
        os.posix_fallocate(fh.fileno(), 0, needed + needed // 2)
    [finding] = check_shm(make_ctx(shm_path=path))
    assert finding.status == "warn" and "only" in finding.message and "torch_*" in finding.fix


def test_roomy_path_is_ok_and_env_variable_chooses_the_path(tmp_path, monkeypatch, make_ctx):
    # tmp_path lives on a disk with more than the few hundred MiB workers need
    [finding] = check_shm(make_ctx(shm_path=tmp_path))
    assert finding.status == "ok" and finding.details["needed_bytes"] == _needed()
    monkeypatch.setenv("GPUKIT_SHM_PATH", str(tmp_path))
    assert _shm(run_checks()).details["path"] == str(tmp_path)


def test_missing_shm_warns(tmp_path, make_ctx):
    # the default /dev/shm missing: a container started without it (the fix is a container flag)
    [finding] = check_shm(make_ctx(shm_path=tmp_path / "absent", shm_source="default"))
    assert finding.status == "warn" and "cannot measure" in finding.message and "--shm-size" in finding.fix


@pytest.mark.parametrize("source", ["GPUKIT_SHM_PATH", "shm_path"])
def test_a_chosen_shm_path_that_is_missing_or_no_directory_fails_and_names_its_source(tmp_path, make_ctx, source):
    regular = tmp_path / "file"
    regular.write_bytes(b"x")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    env = {}
    for path, said in ((tmp_path / "absent", "cannot measure"), (regular, "is a regular file"), (fifo, "is a FIFO")):
        if source == "GPUKIT_SHM_PATH":
            env = {"GPUKIT_SHM_PATH": str(path)}
            ctx = make_ctx(env)
        else:
            ctx = make_ctx(shm_path=path)
        [finding] = check_shm(ctx)
        assert finding.status == "fail" and said in finding.message and source in finding.message, finding
        assert "--shm-size" not in (finding.fix or "")  # not the container's fault
