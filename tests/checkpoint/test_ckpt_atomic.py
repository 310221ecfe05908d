"""Atomic writes: temp naming and cleanup, disk full, permission errors."""

from __future__ import annotations

import errno
import io
import os
import subprocess
from pathlib import Path

import pytest
import torch

import gpukit
from gpukit.checkpoint import _atomic
from gpukit.checkpoint._atomic import atomic_write, clean_temp_files, is_temp_name, temp_path_for
from gpukit.errors import CheckpointError


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_temp_names_are_hidden_recognisable_and_tied_to_target(tmp_path: Path) -> None:
    temp = temp_path_for(tmp_path / "model.pt")
    assert temp.parent == tmp_path and temp.name.startswith(".model.pt.tmp-")
    assert is_temp_name(temp.name)
    assert not is_temp_name("model.pt") and not is_temp_name(".hidden") and not is_temp_name("step_00000001")


def test_leftovers_of_dead_writers_are_removed_by_next_write(tmp_path: Path) -> None:
    dead = tmp_path / f".c.pt.tmp-{_dead_pid()}-deadbeef"
    dead.write_bytes(b"torn")
    alive = tmp_path / f".c.pt.tmp-{os.getppid()}-cafe0000"  # a running process: kept
    alive.write_bytes(b"in progress")
    other = tmp_path / f".other.pt.tmp-{_dead_pid()}-00000000"  # another target: kept
    other.write_bytes(b"x")
    gpukit.save({"x": torch.ones(1)}, tmp_path / "c.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["c.pt", alive.name, other.name])
    assert clean_temp_files(tmp_path) == [other]


class _FullDisk(_atomic._GuardedFile):
    """A temp file on a disk that fills up after ``budget`` bytes (the write raises ENOSPC)."""

    budget = 300

    def write(self, data: bytes) -> int:  # type: ignore[override]
        if self.tell() + len(data) > self.budget:
            self.os_error = OSError(errno.ENOSPC, "No space left on device")
            raise self.os_error
        return super().write(data)

    def pwrite(self, data: memoryview, offset: int) -> int:  # type: ignore[override]
        if offset + len(data) > self.budget:
            self.os_error = OSError(errno.ENOSPC, "No space left on device")
            raise self.os_error
        return super().pwrite(data, offset)


def _full_disk_open(path: Path) -> tuple[io.BufferedRandom, _atomic._GuardedFile]:
    raw = _FullDisk(path, "x+b")
    return io.BufferedRandom(raw, buffer_size=64), raw


def test_disk_full_during_write_keeps_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt.pt"
    gpukit.save({"w": torch.zeros(4)}, path)
    before = path.read_bytes()
    monkeypatch.setattr(_atomic, "_open_temp_file", _full_disk_open)
    with pytest.raises(CheckpointError, match="Disk full: could not write .* after ") as info:
        gpukit.save({"w": torch.ones(10_000)}, path)
    assert str(tmp_path) in str(info.value) and "unchanged" in str(info.value)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # the partial temp file is gone


def test_disk_full_at_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt.pt"
    gpukit.save({"w": torch.zeros(4)}, path)
    before = path.read_bytes()

    def fsync_enospc(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync_enospc)
    with pytest.raises(CheckpointError, match="Disk full.*no space left on the file system"):
        gpukit.save({"w": torch.ones(4)}, path)
    monkeypatch.undo()
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["ckpt.pt"]


def test_permission_denied_on_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests may run as root, which file modes do not stop: simulate EACCES at file creation.
    def deny(path: Path) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(_atomic, "_open_temp_file", deny)
    with pytest.raises(CheckpointError, match="Permission denied writing"):
        gpukit.save({"w": torch.ones(1)}, tmp_path / "x.pt")
    assert not (tmp_path / "x.pt").exists()


def test_atomic_write_returns_size_and_creates_directory(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "dir" / "file.bin"
    assert atomic_write(target, lambda f: f.write(b"abc")) == 3
    assert target.read_bytes() == b"abc"


def test_interrupt_is_not_swallowed(tmp_path: Path) -> None:
    def interrupted(handle: io.BufferedRandom) -> None:
        handle.write(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "f", interrupted)
    assert os.listdir(tmp_path) == []
