"""``gpukit claims clean`` (issue 41 items 2-4): a live claim is freed only with --force, the holder of a
lock whose taker has exited is the process that has it open, and junk goes from a shared folder but
never from a folder of one's own. The same with two real users: tests/hostile/hostage_attacks.py."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from gpukit.devices import claim_gpus, claim_owners, list_gpus
from gpukit.devices._claim_dir import open_claim_folder
from gpukit.devices._claim_files import holder_text
from gpukit.devices._claims_clean import MARKER, clean_folder

TWO = {"gpus": [{"name": "Fake A100", "uuid": f"GPU-{i}ddddddd-0000-4000-8000-00000000000{i}",
                 "memory_total_mib": 40960, "memory_used_mib": 0} for i in range(2)]}


def _holder(orphan: bool) -> tuple[int, int]:
    """A process that claims GPU 0 and holds it (``orphan``: it forks a child that keeps the lock file
    open, and exits). Returns (pid that took the lock, pid holding it now)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            claim = claim_gpus(gpus=[0])
            if orphan and os.fork() != 0:
                os._exit(0)  # the child keeps the lock; /proc/locks still names this pid
            os.write(write_end, f"{os.getpid()}\n".encode())
            time.sleep(120)
            del claim
        finally:
            os._exit(0)
    os.close(write_end)
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(read_end, 64)
        if not chunk:
            break
        data += chunk
    os.close(read_end)
    if orphan:
        os.waitpid(pid, 0)
    return pid, int(data)


def _end(*pids: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def test_a_live_claim_is_freed_only_with_force(use_spec, capsys) -> None:
    use_spec(TWO)
    took, held = _holder(orphan=False)
    try:
        uuid = list_gpus()[0].uuid or ""
        with open_claim_folder() as folder:
            kept = clean_folder(folder, list_gpus(), older_than_s=0)
        assert any(line.startswith("kept GPU 0") and f"pid {held}" in line and "--force" in line for line in kept), kept
        assert claim_owners([uuid])[uuid]["pid"] == held  # still held
        from gpukit.cli._main import main

        main(["claims", "clean", "--older-than", "0", "--force"])  # the CLI, as an administrator runs it
        said = capsys.readouterr().out
        assert said.startswith("freed GPU 0"), said
        with claim_gpus(gpus=[0]):
            pass
    finally:
        _end(took, held)


def test_the_holder_of_a_lock_whose_taker_exited_is_named(use_spec) -> None:
    use_spec(TWO)
    took, held = _holder(orphan=True)
    try:
        uuid = list_gpus()[0].uuid or ""
        owner = claim_owners([uuid])[uuid]
        assert owner is not None and owner["pid"] == held and owner["took_it"] == took
        assert holder_text(owner).endswith(f"inherited from pid {took}, which has exited")
        with open_claim_folder() as folder:
            kept = clean_folder(folder, list_gpus(), older_than_s=0)
        assert any(f"pid {held} (inherited from pid {took}" in line for line in kept), kept
    finally:
        _end(held)


def test_junk_goes_from_a_shared_folder_but_not_from_ones_own(use_spec, tmp_path: Path, monkeypatch) -> None:
    use_spec(TWO)
    own = tmp_path / "claims"
    with claim_gpus(1):
        pass
    os.chmod(own, 0o700)  # (root makes a named folder 1777: this one is meant as one's own)
    (own / "notes.txt").write_text("mine")
    with open_claim_folder() as folder:
        clean_folder(folder, list_gpus())
    assert (own / "notes.txt").exists()  # a folder of one's own: only gpukit's leftovers go
    os.chmod(own, 0o1777)  # shared, but not made by `claims setup` (like /tmp): nothing else goes either
    if os.geteuid() == 0:
        with open_claim_folder() as folder:
            clean_folder(folder, list_gpus())
        assert (own / "notes.txt").exists()
    if os.geteuid() != 0:
        pytest.skip("a shared folder is root's (claims setup)")
    from gpukit.devices._claims_admin import setup_folder

    shared = tmp_path / "shared"
    setup_folder(shared)
    for i in range(50):
        (shared / f"junk.{i}").write_text("x")
    for i in range(300):  # fresh temporary files by the hundred: a flood whatever their age
        (shared / f".tmp.{i:04d}").write_text("x")
    with open_claim_folder(shared, create=False) as folder:
        actions = clean_folder(folder, list_gpus())
    assert sorted(os.listdir(shared)) == sorted([MARKER, *(f"{g.uuid}.lock" for g in list_gpus())])
    assert "removed 45 more (not a file gpukit keeps here, by root)" in actions
    assert "removed 295 more (more unfinished temporary files than gpukit ever keeps, by root)" in actions
