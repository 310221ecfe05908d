"""The claim store as a shared resource: which folder, when it is trusted, files nobody can plant."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gpukit._util.safe_files import folder_info, open_folder, read_bounded, write_note
from gpukit._util.text import printable
from gpukit.devices import _claim_dir, claim_gpus, claim_owners
from gpukit.devices._claim_files import flock_holders, lock_name, note_name
from gpukit.errors import ConfigurationError, DeviceError, GpuSelectionError

TWO = {"gpus": [{"name": "Fake A100", "uuid": f"GPU-{i}ccccccc-0000-4000-8000-00000000000{i}",
                 "memory_total_mib": 40960, "memory_used_mib": 0} for i in range(2)]}
OTHER_UID = 54321  # an account that does not exist: "another user" for ownership checks
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files to another uid (chown)")


def test_printable_escapes_controls_and_keeps_text() -> None:
    assert printable("run \x1b]0;owned\x07 ok") == "run \\x1b]0;owned\\x07 ok"
    assert printable("a\u202eb\tc") == "a\\u202eb\\x09c"
    assert printable("line1\nline2", keep_newlines=True) == "line1\nline2"
    assert printable("x" * 50, max_chars=10) == "x" * 9 + "…"
    assert printable("Grüße, 日本") == "Grüße, 日本"


@pytest.mark.parametrize("value", ["-1", "claims", "./claims"])
def test_a_relative_claim_folder_is_refused(use_spec, monkeypatch, value: str) -> None:
    use_spec(TWO)
    monkeypatch.setenv("GPUKIT_CLAIM_DIR", value)
    with pytest.raises(ConfigurationError, match=rf"GPUKIT_CLAIM_DIR '{value}' is a relative path"):
        claim_gpus(1)
    assert not os.path.exists(value)


def test_the_per_user_folder_is_private_and_said_so(use_spec, monkeypatch, tmp_path: Path, caplog) -> None:
    use_spec(TWO)
    monkeypatch.delenv("GPUKIT_CLAIM_DIR")
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(_claim_dir, "SYSTEM_CLAIM_DIR", tmp_path / "system")
    monkeypatch.setattr(_claim_dir, "_NOTICE_GIVEN", False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path / "no-home"))  # no home folder: the temp dir's
    with caplog.at_level(logging.WARNING, logger="gpukit.devices"):
        with claim_gpus(1) as claim:
            assert claim.claim_dir == tmp_path / f"gpukit-claims-{os.geteuid()}"
            assert stat.S_IMODE(os.stat(claim.claim_dir).st_mode) == 0o700
        with claim_gpus(1):
            pass
    notices = [r.getMessage() for r in caplog.records if "only your own jobs" in r.getMessage()]
    assert len(notices) == 1 and "sudo gpukit claims setup" in notices[0]  # once per process


def test_the_per_user_default_is_a_place_no_one_else_can_make_first(use_spec, monkeypatch, tmp_path: Path) -> None:
    """Issue 41 item 6: with a home folder of this user's, claims go under it (per host), not to the
    predictable <tmp>/gpukit-claims-<uid> another user could make first."""
    import socket

    use_spec(TWO)
    monkeypatch.delenv("GPUKIT_CLAIM_DIR")
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(_claim_dir, "SYSTEM_CLAIM_DIR", tmp_path / "system")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    (tmp_path / f"gpukit-claims-{os.geteuid()}").mkdir(mode=0o777)  # made first "by someone": not used
    with claim_gpus(1) as claim:
        assert claim.claim_dir.parent == home / ".cache" / "gpukit"
        assert claim.claim_dir.name.startswith("claims-") and socket.gethostname()[:5] in claim.claim_dir.name
        assert stat.S_IMODE(os.stat(claim.claim_dir).st_mode) == 0o700
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))  # the user's own runtime folder comes first
    with claim_gpus(1) as claim:
        assert claim.claim_dir == runtime / "gpukit-claims"
    if os.geteuid() == 0:  # a home folder that is not this user's is not used
        os.chown(home, OTHER_UID, -1)
        monkeypatch.delenv("XDG_RUNTIME_DIR")
        assert _claim_dir.default_claim_dir() == tmp_path / f"gpukit-claims-{os.geteuid()}"


def test_the_shared_folder_is_used_when_an_administrator_made_it(use_spec, monkeypatch, tmp_path: Path) -> None:
    from gpukit.devices._claims_admin import setup_folder

    use_spec(TWO)
    monkeypatch.delenv("GPUKIT_CLAIM_DIR")
    shared = tmp_path / "system"
    monkeypatch.setattr(_claim_dir, "SYSTEM_CLAIM_DIR", shared)
    if os.geteuid() != 0:
        with pytest.raises(DeviceError, match="run it as root"):
            setup_folder(shared)
        return
    actions = setup_folder(shared)
    assert f"made {shared}" in actions and sum(a.startswith("made GPU-") for a in actions) == 2
    info = os.stat(shared)
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o1777)
    with claim_gpus(1) as claim:
        assert claim.claim_dir == shared
    assert setup_folder(shared) == []  # nothing to change the second time
    os.chmod(shared, 0o1775)  # broken by hand: refused, with the repair
    with pytest.raises(DeviceError, match=r"must be root-owned, world-writable and sticky .*sudo gpukit claims setup"):
        claim_gpus(1)


@root_only
@pytest.mark.parametrize(("mode", "problem"), [(0o755, "belongs to uid 54321"), (0o1777, "belongs to uid 54321")])
def test_another_users_folder_is_refused_naming_them(use_spec, tmp_path: Path, monkeypatch, mode, problem) -> None:
    use_spec(TWO)
    folder = tmp_path / "theirs"
    folder.mkdir()
    os.chown(folder, OTHER_UID, OTHER_UID)
    os.chmod(folder, mode)
    monkeypatch.setenv("GPUKIT_CLAIM_DIR", str(folder))
    with pytest.raises(DeviceError, match=problem):
        claim_gpus(1)
    with pytest.raises(DeviceError, match=problem):
        claim_owners(["GPU-x"])


def test_a_world_writable_folder_that_is_not_sticky_is_refused(use_spec, tmp_path: Path, monkeypatch) -> None:
    use_spec(TWO)
    folder = tmp_path / "open"
    folder.mkdir()
    os.chmod(folder, 0o777)
    monkeypatch.setenv("GPUKIT_CLAIM_DIR", str(folder))
    with pytest.raises(DeviceError, match=r"not sticky, so any user could delete or replace"):
        claim_gpus(1)


def test_a_symlinked_or_file_claim_folder_is_refused(use_spec, tmp_path: Path, monkeypatch) -> None:
    use_spec(TWO)
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    monkeypatch.setenv("GPUKIT_CLAIM_DIR", str(tmp_path / "link"))
    with pytest.raises(DeviceError, match="it is a symlink"):
        claim_gpus(1)
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("GPUKIT_CLAIM_DIR", str(tmp_path / "file"))
    with pytest.raises(DeviceError, match="it is a regular file .*not a directory"):
        claim_gpus(1)


def test_planted_lock_entries_make_a_gpu_unclaimable_never_hang(use_spec, tmp_path: Path) -> None:
    use_spec(TWO)
    folder = Path(os.environ["GPUKIT_CLAIM_DIR"])
    with claim_gpus(2):
        pass  # makes the folder and both lock files
    uuids = [g["uuid"] for g in TWO["gpus"]]
    os.unlink(folder / lock_name(uuids[0]))
    os.mkfifo(folder / lock_name(uuids[0]))  # a FIFO: opening it for reading would wait for a writer
    os.unlink(folder / lock_name(uuids[1]))
    os.symlink("/dev/zero", folder / lock_name(uuids[1]))
    started = time.monotonic()
    with pytest.raises(GpuSelectionError) as info:
        claim_gpus(1)
    assert time.monotonic() - started < 10
    text = str(info.value)
    assert f"blocked: its lock file {lock_name(uuids[0])} is a FIFO made by" in text
    assert f"blocked: its lock file {lock_name(uuids[1])} is a symlink made by" in text
    owners = claim_owners(uuids)
    assert all(owner["blocked"] for owner in owners.values())


@root_only
def test_a_lock_file_of_anyone_but_the_folders_owner_is_not_used(use_spec) -> None:
    use_spec(TWO)
    folder = Path(os.environ["GPUKIT_CLAIM_DIR"])
    with claim_gpus(2):
        pass
    uuid = TWO["gpus"][0]["uuid"]
    os.chown(folder / lock_name(uuid), OTHER_UID, OTHER_UID)  # as if another user had made it
    with pytest.raises(GpuSelectionError, match=r"GPU 0 .*made by uid 54321, not by the folder's owner"):
        claim_gpus(gpus=[0])
    with claim_gpus(1) as claim:
        assert claim.gpus[0].index == 1


def test_the_holder_comes_from_the_kernel_and_notes_are_checked(use_spec, tmp_path: Path) -> None:
    use_spec(TWO)
    folder = Path(os.environ["GPUKIT_CLAIM_DIR"])
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from gpukit.devices import claim_gpus\n"
         "c = claim_gpus(gpus=[0]); c.label('gpukit-run\\x1b[2J', [3]); print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        uuid = TWO["gpus"][0]["uuid"]
        owner = claim_owners([uuid])[uuid]
        assert owner["pid"] == holder.pid and owner["rank"] == 3 and owner["run"] == "gpukit-run\x1b[2J"
        note = folder / note_name(uuid, holder.pid)
        assert stat.S_IMODE(os.stat(note).st_mode) == 0o644
        # a note that is not the holder's (wrong pid) is never read; an oversized one is ignored
        note.write_bytes(b" " * 100_000)
        owner = claim_owners([uuid])[uuid]
        assert owner["pid"] == holder.pid and "run" not in owner
        assert (os.stat(folder / lock_name(uuid)).st_dev, os.stat(folder / lock_name(uuid)).st_ino) in flock_holders()
    finally:
        holder.communicate("")
    assert claim_owners([TWO["gpus"][0]["uuid"]]) == {}


def test_files_are_readable_by_others_whatever_the_umask(use_spec) -> None:
    use_spec(TWO)
    old = os.umask(0o077)
    try:
        with claim_gpus(1) as claim:
            folder = claim.claim_dir
            for name in (lock_name(claim.gpus[0].uuid or ""), note_name(claim.gpus[0].uuid or "", os.getpid())):
                assert stat.S_IMODE(os.stat(folder / name).st_mode) == 0o644, name
    finally:
        os.umask(old)


def test_notes_never_write_through_a_planted_name(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "note").symlink_to(victim)
    fd = open_folder(folder)
    try:
        write_note(fd, "note", b"{}")  # replaces the symlink itself (own folder), never writes through it
        assert victim.read_text() == "keep me" and not (folder / "note").is_symlink()
        assert [p.name for p in folder.iterdir()] == ["note"]  # no temp file left
        assert read_bounded(os.open(folder / "note", os.O_RDONLY), 1) is None  # more than the bound
        assert folder_info(fd).trusted
    finally:
        os.close(fd)


def test_ls_and_doctor_report_blocked_gpus_and_leftovers(use_spec, capsys) -> None:
    from gpukit.cli import main

    use_spec(TWO)
    folder = Path(os.environ["GPUKIT_CLAIM_DIR"])
    with claim_gpus(2):
        pass
    uuid = TWO["gpus"][1]["uuid"]
    os.unlink(folder / lock_name(uuid))
    os.mkfifo(folder / lock_name(uuid))
    (folder / "ticket.junk").symlink_to("/dev/zero")
    (folder / note_name(uuid, 999999)).write_text(json.dumps({"run": "gone"}))
    main(["ls"])
    out = " ".join(capsys.readouterr().out.split())  # undo rich's wrapping
    assert "blocked by" in out and f"GPU 1 (Fake A100) cannot be claimed: its lock file {lock_name(uuid)} is a FIFO" \
        in out
    with pytest.raises(SystemExit) as exit_info:
        main(["doctor"])
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    assert "FAIL gpu.claims: GPU 1 (Fake A100) cannot be claimed" in out
    assert "leftover file(s)" in out and "gpukit claims clean" in out
    main(["claims", "clean"])
    cleaned = capsys.readouterr().out
    assert "removed ticket.junk" in cleaned and f"removed {lock_name(uuid)}" in cleaned
    assert f"removed {note_name(uuid, 999999)}" in cleaned
    with claim_gpus(2):
        pass


@root_only
def test_a_kernel_that_lets_anyone_hard_link_is_reported_for_a_shared_folder(use_spec, monkeypatch, tmp_path: Path,
                                                                             capsys) -> None:
    """The queue's order is each ticket's change time; a hard link made by another user would reset it."""
    from gpukit.cli import main
    from gpukit.devices import _claims_admin

    use_spec(TWO)
    shared = tmp_path / "system"
    monkeypatch.setenv("GPUKIT_CLAIM_DIR", str(shared))
    setting = tmp_path / "protected_hardlinks"
    monkeypatch.setattr(_claims_admin, "PROTECTED_HARDLINKS", str(setting))
    setting.write_text("1\n")
    main(["claims", "setup", "--dir", str(shared)])
    assert "protected_hardlinks" not in capsys.readouterr().err
    main(["ls"])
    assert "protected_hardlinks" not in capsys.readouterr().out
    setting.write_text("0\n")
    main(["claims", "setup", "--dir", str(shared)])
    assert "warning: the kernel lets any user hard-link files they cannot write (fs.protected_hardlinks = 0)" in \
        capsys.readouterr().err
    main(["ls"])
    assert "fs.protected_hardlinks = 0" in " ".join(capsys.readouterr().out.split())
    main(["doctor"])  # a warning: exit 0
    out = " ".join(capsys.readouterr().out.split())
    assert "WARN gpu.claims: the kernel lets any user hard-link" in out and "sysctl -w fs.protected_hardlinks=1" in out
    own = tmp_path / "own"  # a folder nobody else can write in: the setting does not matter there
    own.mkdir(mode=0o700)
    monkeypatch.setenv("GPUKIT_CLAIM_DIR", str(own))
    with claim_gpus(1):
        pass
    main(["doctor"])
    assert "protected_hardlinks" not in capsys.readouterr().out


@root_only
def test_a_claim_folder_reached_through_another_users_symlink_is_refused(use_spec, tmp_path: Path,
                                                                         monkeypatch) -> None:
    """Issue 41 item 5: root never follows another user's symlink anywhere in the path (a planted
    parent would have root make a world-writable folder wherever that user points it)."""
    use_spec(TWO)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "x").symlink_to(elsewhere)
    os.lchown(tmp_path / "x", OTHER_UID, -1)
    monkeypatch.setenv("GPUKIT_CLAIM_DIR", str(tmp_path / "x" / "claims"))
    with pytest.raises(DeviceError, match=r"x on the way is a symlink of uid 54321's"):
        claim_gpus(1)
    assert not (elsewhere / "claims").exists()
    os.lchown(tmp_path / "x", 0, -1)  # root's own symlink is followed
    with claim_gpus(1) as claim:
        assert (elsewhere / "claims").is_dir() and len(claim.gpus) == 1
