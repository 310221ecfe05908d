"""Rotation keeps retired files for the next save to overwrite; the batched zip writer's layout."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from gpukit import CheckpointManager
from gpukit.checkpoint import _reuse, _zipwrite, wait_for_saves
from gpukit.checkpoint._atomic import _GuardedFile, atomic_write
from gpukit.checkpoint._manager import SHARED_FILE


def _offsets(data: bytes) -> dict[str, int]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        assert archive.testzip() is None  # every record's CRC matches its bytes
        return {info.filename.split("/", 1)[1]: info.header_offset for info in archive.infolist()}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("target", ["fd", "pwrite-only", "guarded"])
def test_batched_writer_lays_records_out_as_torch_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       threads: int, target: str) -> None:
    # small limits, so the state has records in runs, whole large records and split ones
    monkeypatch.setattr(_zipwrite, "CHUNK_BYTES", 64 * 1024)
    monkeypatch.setattr(_zipwrite, "SMALL_BYTES", 4 * 1024)
    torch.manual_seed(0)
    state = {"split": torch.randn(70_000), "whole": torch.randn(5_000), "empty": torch.empty(0),
             "small": [torch.randn(n) for n in (1, 100, 900)], "ints": torch.arange(3000)}
    path = tmp_path / "out.pt"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        if target == "fd":
            size = _zipwrite.write_torch_zip(fd, state, {"k": "v"}, threads=threads)
        elif target == "pwrite-only":
            size = _zipwrite.write_torch_zip(lambda data, offset: os.pwrite(fd, data, offset), state, {"k": "v"},
                                             threads=threads)
        else:
            guarded = _GuardedFile(fd, "r+b", closefd=False)
            size = _zipwrite.write_torch_zip(guarded.pwrite, state, {"k": "v"}, threads=threads,
                                             pwritev=guarded.pwritev)
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert len(data) == size
    reference = io.BytesIO()
    torch.save(state, reference)
    ours, theirs = _offsets(data), _offsets(reference.getvalue())
    # the records before the trailer (gpukit's metadata record comes before torch's "version")
    shared = [name for name in theirs if name == "data.pkl" or name.startswith(("data/", "byteorder"))]
    assert len(shared) >= 8
    assert {n: ours[n] for n in shared} == {n: theirs[n] for n in shared}  # torch.load relies on it
    loaded = torch.load(path, weights_only=True)
    for key in ("split", "whole", "empty", "ints"):
        assert torch.equal(loaded[key], state[key])
    assert all(torch.equal(a, b) for a, b in zip(loaded["small"], state["small"]))


def _model(width: int) -> nn.Module:
    torch.manual_seed(width)
    return nn.Sequential(nn.Linear(width, width), nn.Linear(width, 4))


@pytest.mark.parametrize("background", [False, True])
def test_rotation_keeps_the_retired_file_and_the_next_save_overwrites_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, background: bool) -> None:
    monkeypatch.setattr(_reuse, "MIN_REUSE_BYTES", 1)
    manager = CheckpointManager(tmp_path, keep_last=1)
    big = _model(256)
    manager.save(1, model=big, background=background)
    wait_for_saves()
    first = os.stat(manager.step_directory(1) / SHARED_FILE)
    manager.save(2, model=big, background=background)
    wait_for_saves()
    kept = tmp_path / _reuse.REUSE_DIR / SHARED_FILE
    assert os.stat(kept).st_ino == first.st_ino  # moved aside, not deleted
    second = os.stat(manager.step_directory(2) / SHARED_FILE)
    assert sorted(os.listdir(tmp_path)) == [_reuse.REUSE_DIR, "step_00000002"]
    small = _model(64)  # a smaller state: the reused file is cut to its new size
    manager.save(3, model=small, extra={"n": 3}, background=background)
    wait_for_saves()
    written = manager.step_directory(3) / SHARED_FILE
    assert os.stat(written).st_ino == first.st_ino  # step 1's file, overwritten
    assert os.stat(kept).st_ino == second.st_ino  # step 2's, retired in turn
    assert written.stat().st_size < first.st_size
    with zipfile.ZipFile(written) as archive:
        assert archive.testzip() is None
    fresh = _model(64)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    assert manager.resume(model=fresh) == 3 and manager.extra == {"n": 3}
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), small.state_dict().values()))


def test_reuse_off_deletes_retired_files_and_the_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_reuse, "MIN_REUSE_BYTES", 1)
    model = _model(64)
    CheckpointManager(tmp_path, keep_last=1).save(1, model=model)
    CheckpointManager(tmp_path, keep_last=1).save(2, model=model)
    assert (tmp_path / _reuse.REUSE_DIR / SHARED_FILE).is_file()
    manager = CheckpointManager(tmp_path, keep_last=1, reuse_files=False)
    manager.save(3, model=model)
    assert sorted(os.listdir(tmp_path)) == ["step_00000003"]


def test_small_files_are_not_kept(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=1)
    for step in (1, 2, 3):
        manager.save(step, model=_model(8))
    assert sorted(os.listdir(tmp_path)) == ["step_00000003"]  # below MIN_REUSE_BYTES: deleted


def test_atomic_write_with_a_vanished_reuse_file_creates_a_new_one(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    size = atomic_write(target, lambda handle: handle.write(b"abc"), reuse=tmp_path / "gone")
    assert size == 3 and target.read_bytes() == b"abc"
    assert sorted(os.listdir(tmp_path)) == ["out.bin"]


def test_a_retired_directory_never_looks_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a crash between moving the file aside and deleting the rest: the checkpoint is not listed
    monkeypatch.setattr(_reuse, "MIN_REUSE_BYTES", 1)
    monkeypatch.setattr(_reuse.shutil, "rmtree", lambda *args, **kwargs: None)
    manager = CheckpointManager(tmp_path, keep_last=1)
    model = _model(64)
    manager.save(1, model=model)
    manager.save(2, model=model)
    assert manager.checkpoints() == [manager.step_directory(2)]
    monkeypatch.undo()
    manager.save(3, model=model)  # the next save removes the debris
    assert sorted(os.listdir(tmp_path)) == [_reuse.REUSE_DIR, "step_00000003"]


def test_a_file_with_another_hard_link_is_never_overwritten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a user's backup made with `cp -l` / `rsync --link-dest` shares the file: reuse would change it
    monkeypatch.setattr(_reuse, "MIN_REUSE_BYTES", 1)
    ckpt, backup = tmp_path / "ckpt", tmp_path / "backup"
    backup.mkdir()
    manager = CheckpointManager(ckpt, keep_last=1)
    manager.save(1, model=_model(64))
    os.link(manager.step_directory(1) / SHARED_FILE, backup / SHARED_FILE)
    before = (backup / SHARED_FILE).read_bytes()
    manager.save(2, model=_model(65))  # retires step 1: its file has two names, so it is not kept
    assert not (ckpt / _reuse.REUSE_DIR / SHARED_FILE).exists()
    manager.save(3, model=_model(66))  # step 2's file is kept (one name) ...
    kept = ckpt / _reuse.REUSE_DIR / SHARED_FILE
    assert kept.is_file()
    os.link(kept, backup / "late-link.pt")  # ... and linked after it was kept: the next save must not adopt it
    late = kept.read_bytes()
    manager.save(4, model=_model(67))
    assert (backup / SHARED_FILE).read_bytes() == before
    assert (backup / "late-link.pt").read_bytes() == late
    fresh = _model(67)
    assert manager.resume(model=fresh) == 4
