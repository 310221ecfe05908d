"""Attacks on the claim store by a second, unfriendly user of the same machine (issue 26).

Two real unprivileged accounts (``tests/devices/other_users.py``): ``gpukit-bob`` attacks,
``gpukit-alice`` is the victim. Every probe builds its own world under a fresh root-owned
folder (a fake 4-GPU spec, a sticky "temp dir", the victim's private file), lets bob plant his
files, runs one of alice's gpukit commands (the library or the CLI, in a process of hers), and
says what happened. Nothing is committed: every input is made here, at test time.

Outcomes (the multi-user table of bench/RESULTS.md; the goal is 0 in the last five):

* ``refused cleanly`` -- a gpukit error (CLI: exit 2 with one ``gpukit: error:`` line) that names
  the other user when he caused it;
* ``correct`` -- it worked, and did the right thing (the probe's own check);
* ``wrong`` -- anything else: an escape sequence reached the terminal, an error that does not say
  who caused it, a check that failed;
* ``hang`` -- it did not finish within the probe's time (it is killed);
* ``traceback`` -- a Python exception that is not a gpukit error;
* ``file changed`` -- alice's private file changed (content, mode, owner or inode);
* ``claim stolen`` -- two processes held one GPU.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "devices"))

from other_users import Holder, Outcome, User, cli, run_as, shared_area, start_as, sticky_folder  # noqa: E402

OUTCOMES = ("refused cleanly", "correct", "wrong", "hang", "traceback", "file changed", "claim stolen")
SAFE = ("refused cleanly", "correct")
ESC = "\x1b"
UUIDS = [f"GPU-{i}1111111-2222-4333-8444-55555555555{i}" for i in range(4)]


def _spec(processes: dict[int, list[dict[str, Any]]] | None = None) -> dict[str, Any]:
    return {"driver_version": "550.54.15", "gpus": [
        {"name": "NVIDIA A100", "uuid": uuid, "memory_total_mib": 40960, "memory_used_mib": 0,
         "utilization_gpu_pct": 0, "processes": (processes or {}).get(i, [])} for i, uuid in enumerate(UUIDS)]}


@dataclass
class World:
    """One probe's machine: the folders, the spec, the two users and alice's private file."""

    base: Path
    alice: User
    bob: User
    spec: Path
    tmp: Path  # a /tmp of this world: root-owned, sticky, world-writable
    claims: Path  # the shared claim folder (made by `claims setup` where a probe says so)
    secret: Path  # alice's private file: no gpukit command of hers may change it
    env: dict[str, str] = field(default_factory=dict)

    def write_spec(self, spec: dict[str, Any]) -> None:
        self.spec.write_text(json.dumps(spec))
        os.chmod(self.spec, 0o644)

    def fingerprint(self) -> tuple[Any, ...]:
        info = os.lstat(self.secret)
        return (self.secret.read_bytes(), stat.S_IMODE(info.st_mode), info.st_uid, info.st_ino)


def make_world(alice: User, bob: User) -> World:
    base = shared_area()
    home = base / "alice"
    home.mkdir()
    secret = home / "secret"
    secret.write_text("alice's secret\n")
    os.chmod(secret, 0o600)
    os.chown(secret, alice.uid, alice.gid)
    os.chmod(home, 0o755)  # bob may name the file (symlinks), not read it
    os.chown(home, alice.uid, alice.gid)
    world = World(base, alice, bob, base / "spec.json", sticky_folder(base / "tmp"), base / "claims", secret)
    world.write_spec(_spec())
    world.env = {"GPUKIT_FAKE_GPUS": str(world.spec), "TMPDIR": str(world.tmp), "HOME": str(home)}
    return world


def setup_shared(world: World) -> None:
    """What an administrator does once: ``gpukit claims setup --dir <claims>`` (as root, here)."""
    from gpukit.devices import _nvml
    from gpukit.devices._claims_admin import setup_folder

    os.environ["GPUKIT_FAKE_GPUS"] = str(world.spec)
    _nvml.shutdown()
    setup_folder(world.claims)
    world.env["GPUKIT_CLAIM_DIR"] = str(world.claims)


def as_bob(world: World, fn: Callable[..., Any], *args: Any, **kw: Any) -> Outcome:
    return run_as(world.bob, functools.partial(fn, *args, **kw), env=dict(world.env), timeout_s=30)


def as_alice(world: World, fn: Callable[..., Any], *args: Any, **kw: Any) -> Outcome:
    return run_as(world.alice, functools.partial(fn, *args, **kw), env=dict(world.env), timeout_s=30)


_GPUKIT_ERRORS: set[str] | None = None


def _gpukit_errors() -> set[str]:
    global _GPUKIT_ERRORS
    if _GPUKIT_ERRORS is None:
        import gpukit.errors as errors

        _GPUKIT_ERRORS = {name for name, value in vars(errors).items()
                          if isinstance(value, type) and issubclass(value, errors.GpukitError)}
    return _GPUKIT_ERRORS


def judge(outcome: Outcome, *, names: str | None = None, check: Callable[[Outcome], bool] | None = None,
          cli_run: bool = False, expect: str | None = None) -> str:
    """The outcome of one victim action (see the module docstring); ``names``: the user an error must
    name; ``expect``: the one safe outcome that is right here (the other one then counts as wrong)."""
    verdict = _judge(outcome, names, check, cli_run)
    return "wrong" if expect is not None and verdict in SAFE and verdict != expect else verdict


def _judge(outcome: Outcome, names: str | None, check: Callable[[Outcome], bool] | None, cli_run: bool) -> str:
    if outcome.kind == "hang":
        return "hang"
    if ESC in outcome.stdout or ESC in outcome.stderr or ESC in outcome.message:
        return "wrong"
    if "Traceback (most recent call last)" in outcome.stderr:
        return "traceback"
    if outcome.kind == "raise":
        if outcome.error_type not in _gpukit_errors():
            return "traceback"
        return "refused cleanly" if names is None or names in outcome.message else "wrong"
    if cli_run and outcome.value == 2:
        lines = [line for line in outcome.stderr.splitlines() if line.strip()]
        clean = bool(lines) and lines[0].startswith("gpukit: error:")
        return "refused cleanly" if clean and (names is None or names in outcome.stderr) else "wrong"
    if check is not None and not check(outcome):
        return "wrong"
    return "correct"


# -- what bob plants ----------------------------------------------------------------------------------

def _plant_links(folder: str, target: str, names: list[str]) -> int:
    made = 0
    for name in names:
        try:
            os.symlink(target, os.path.join(folder, name))
            made += 1
        except OSError:
            pass
    return made


def _make_folder(path: str, mode: int) -> None:
    os.mkdir(path)
    os.chmod(path, mode)


def _mkfifo(path: str) -> None:
    os.mkfifo(path)
    os.chmod(path, 0o666)


def _note_names(pids: range) -> list[str]:
    return [f"{uuid}.{pid}.owner" for uuid in UUIDS for pid in pids] + [
        f".{uuid}.owner.{pid}.tmp" for uuid in UUIDS for pid in pids]  # the names older gpukit used


# -- alice's actions ------------------------------------------------------------------------------------

def _claim(**kw: Any) -> list[str]:
    from gpukit.devices import claim_gpus

    with claim_gpus(**kw) as claim:
        return [g.uuid or "" for g in claim.gpus]


def _ls_json() -> dict[str, Any]:
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = cli("ls", "--json")
    return {"code": code, "data": json.loads(buffer.getvalue()) if code == 0 else None}


# -- the probes -----------------------------------------------------------------------------------------
# Each returns [(reader, outcome), ...]: one attack, seen by one or more of alice's commands.

Result = list[tuple[str, str]]


def bob_owns_the_shared_folder(world: World) -> Result:
    """Bob makes the claim folder everyone is told to use before anyone else, and plants symlinks
    to alice's file under every note name (old and new) for the next pids."""
    folder = str(world.tmp / "gpukit-claims")
    as_bob(world, _make_folder, folder, 0o1777)
    start = os.getpid()
    as_bob(world, _plant_links, folder, str(world.secret), _note_names(range(start, start + 300)))
    world.env["GPUKIT_CLAIM_DIR"] = folder
    before = world.fingerprint()
    out = [("claim_gpus", judge(as_alice(world, _claim, count=1), names="gpukit-bob", expect="refused cleanly")),
           ("gpukit ls", judge(as_alice(world, cli, "ls"), cli_run=True, check=lambda o: "gpukit-bob" in o.stdout)),
           ("gpukit doctor", judge(as_alice(world, cli, "doctor"), check=lambda o: o.value == 1
                                   and "gpukit-bob" in o.stdout))]
    return _file_check(world, before, out)


def bob_premakes_a_0755_folder(world: World) -> Result:
    """Bob makes the claim folder 0755 (only he can write): every claim would fail."""
    folder = str(world.tmp / "gpukit-claims")
    as_bob(world, _make_folder, folder, 0o755)
    world.env["GPUKIT_CLAIM_DIR"] = folder
    return [("claim_gpus", judge(as_alice(world, _claim, count=1), names="gpukit-bob", expect="refused cleanly")),
            ("gpukit select", judge(as_alice(world, cli, "select"), cli_run=True, names="gpukit-bob")),
            ("gpukit doctor", judge(as_alice(world, cli, "doctor"), check=lambda o: o.value == 1
                                    and "gpukit-bob" in o.stdout))]


def bob_premakes_alices_own_folder(world: World) -> Result:
    """No shared folder: bob makes the per-user folder alice would use, in the sticky temp dir."""
    folder = str(world.tmp / f"gpukit-claims-{world.alice.uid}")
    as_bob(world, _make_folder, folder, 0o777)
    return [("claim_gpus", judge(as_alice(world, _claim, count=1), names="gpukit-bob", expect="refused cleanly"))]


def symlinks_at_alices_note_names(world: World) -> Result:
    """Shared folder made by setup. Bob knows the pid of alice's next job and plants symlinks to her
    file, a FIFO and /dev/zero where its notes will go; then alice claims, and looks."""
    setup_shared(world)
    holder = Holder(world.alice, {"count": 1}, env=dict(world.env), gate=True)
    pid = holder.pid
    folder = str(world.claims)
    as_bob(world, _plant_links, folder, str(world.secret), [f"{UUIDS[0]}.{pid}.owner", f"{UUIDS[1]}.{pid}.owner"])
    as_bob(world, _plant_links, folder, "/dev/zero", [f"{UUIDS[2]}.{pid}.owner"])
    as_bob(world, _mkfifo, os.path.join(folder, f"{UUIDS[3]}.{pid}.owner"))
    before = world.fingerprint()
    holder.go()
    held = holder.wait_claimed()
    out = [("claim_gpus", "correct" if held else judge(Outcome("raise", error_type="?", message=holder.error or "")))]
    if held:
        shown = as_alice(world, _ls_json)
        owners = {c["uuid"]: c for c in (shown.value or {}).get("data", {}).get("claims", [])} if shown.kind == "ok" \
            else {}
        out.append(("gpukit ls", judge(shown, check=lambda o: owners.get(held[0], {}).get("pid") == pid)))
        out.append(("gpukit select", judge(as_alice(world, cli, "select", "-n", "4"), cli_run=True)))
        out.append(("gpukit doctor", judge(as_alice(world, cli, "doctor"), check=lambda o: o.value in (0, 1))))
    holder.release()
    return _file_check(world, before, out)


def bob_removes_a_held_lock(world: World) -> Result:
    """Alice holds a GPU; bob tries to remove or replace its lock file, then claims that GPU."""
    setup_shared(world)
    holder = Holder(world.alice, {"gpus": [0]}, env=dict(world.env))
    held = holder.wait_claimed()
    name = os.path.join(str(world.claims), f"{UUIDS[0]}.lock")
    tried = as_bob(world, _remove_and_replace, name)
    stolen = as_bob(world, _claim, gpus=[0])
    holder.release()
    if held and stolen.kind == "ok":
        return [("claim_gpus", "claim stolen")]
    ok = tried.kind == "ok" and tried.value == "refused"
    return [("claim_gpus", judge(stolen, names="gpukit-alice") if ok else "wrong")]


def _remove_and_replace(name: str) -> str:
    for attempt in (lambda: os.unlink(name), lambda: os.rename(name, name + ".x"),
                    lambda: open(name, "w").close()):
        try:
            attempt()
            return "done"
        except PermissionError:
            continue
    return "refused"


def bob_plants_lock_files(world: World) -> Result:
    """A shared folder an administrator made by hand (no lock files): bob creates 0644 lock files for
    every GPU first. Claims must not trust them, and say who made them; `claims clean` fixes it."""
    sticky_folder(world.claims)
    world.env["GPUKIT_CLAIM_DIR"] = str(world.claims)
    as_bob(world, _touch_all, str(world.claims), [f"{u}.lock" for u in UUIDS])
    out = [("claim_gpus", judge(as_alice(world, _claim, count=1), names="gpukit-bob", expect="refused cleanly")),
           ("gpukit doctor", judge(as_alice(world, cli, "doctor"), check=lambda o: o.value == 1
                                   and "gpukit-bob" in o.stdout))]
    _as_root_clean(world, 600)
    out.append(("claim_gpus after claims clean",
                judge(as_alice(world, _claim, count=4), check=lambda o: sorted(o.value) == sorted(UUIDS), expect="correct")))
    return out


def _touch_all(folder: str, names: list[str]) -> None:
    for name in names:
        fd = os.open(os.path.join(folder, name), os.O_CREAT | os.O_WRONLY, 0o644)
        os.close(fd)


def _as_root_clean(world: World, older_than_s: float) -> list[str]:
    from gpukit.devices import _nvml, list_gpus
    from gpukit.devices._claim_dir import open_claim_folder
    from gpukit.devices._claims_admin import clean_folder, setup_folder

    os.environ["GPUKIT_FAKE_GPUS"] = str(world.spec)
    _nvml.shutdown()
    actions = setup_folder(world.claims)
    with open_claim_folder(world.claims, create=False) as folder:
        actions += clean_folder(folder, list_gpus(), older_than_s=older_than_s)
    return actions


def bob_plants_special_files_in_alices_folder(world: World) -> Result:
    """Alice made a world-writable sticky claim folder of her own; bob plants a FIFO, an unreadable
    file, a symlink to /dev/zero and a folder where the GPUs' locks go, and junk tickets."""
    folder = world.base / "alice-claims"
    folder.mkdir()
    os.chown(folder, world.alice.uid, world.alice.gid)
    os.chmod(folder, 0o1777)
    world.env["GPUKIT_CLAIM_DIR"] = str(folder)
    as_bob(world, _plant_special, str(folder))
    out = [("gpukit ls", judge(as_alice(world, cli, "ls"), cli_run=True, check=lambda o: "gpukit-bob" in o.stdout)),
           ("gpukit select", judge(as_alice(world, cli, "select"), cli_run=True, names="gpukit-bob")),
           ("gpukit doctor", judge(as_alice(world, cli, "doctor"), check=lambda o: o.value == 1
                                   and "gpukit-bob" in o.stdout)),
           ("claim_gpus", judge(as_alice(world, _claim, count=1), names="gpukit-bob"))]
    cleaned = as_alice(world, cli, "claims", "clean")
    out.append(("gpukit claims clean", judge(cleaned, cli_run=True,
                                             check=lambda o: o.value == 0 and "could not" not in o.stdout)))
    out.append(("claim_gpus after claims clean",
                judge(as_alice(world, _claim, count=4), check=lambda o: sorted(o.value) == sorted(UUIDS), expect="correct")))
    return out


def _plant_special(folder: str) -> None:
    _mkfifo(os.path.join(folder, f"{UUIDS[0]}.lock"))
    fd = os.open(os.path.join(folder, f"{UUIDS[1]}.lock"), os.O_CREAT | os.O_WRONLY, 0o600)
    os.close(fd)
    os.symlink("/dev/zero", os.path.join(folder, f"{UUIDS[2]}.lock"))
    os.mkdir(os.path.join(folder, f"{UUIDS[3]}.lock"))
    _mkfifo(os.path.join(folder, "ticket.fifo"))
    os.symlink("/dev/zero", os.path.join(folder, "ticket.zero"))


def planted_claim_is_reported_and_cleaned(world: World) -> Result:
    """Bob holds a claim on GPU 0 and never uses it (a planted claim): alice's ls/doctor name him and
    its age, root's `gpukit claims clean` frees it, and alice then gets GPU 0."""
    setup_shared(world)
    holder = Holder(world.bob, {"gpus": [0]}, env=dict(world.env))
    holder.wait_claimed()
    import gpukit.devices._claims_admin as admin

    saved, admin.STALE_AFTER_S = admin.STALE_AFTER_S, 0.0  # inherited by alice's processes (forked)
    try:
        out = [("gpukit ls", judge(as_alice(world, cli, "ls"), cli_run=True,
                                   check=lambda o: "stale or planted" in o.stdout and "gpukit-bob" in o.stdout)),
               ("gpukit doctor", judge(as_alice(world, cli, "doctor"),
                                       check=lambda o: "stale or planted" in o.stdout and "gpukit-bob" in o.stdout))]
    finally:
        admin.STALE_AFTER_S = saved
    actions = _as_root_clean(world, 0)
    out.append(("claim_gpus after claims clean", judge(as_alice(world, _claim, gpus=[0]),
                                                       check=lambda o: o.value == [UUIDS[0]] and any(
                                                           "freed" in a for a in actions))))
    holder.release()
    return out


def clean_keeps_a_gpu_in_use(world: World) -> Result:
    """Bob's claim on GPU 0 is old but bob's process runs on it (NVML): clean must leave it, and alice
    must not get GPU 0 -- also after root removed its lock file by hand."""
    world.write_spec(_spec({0: [{"pid": 4242, "user": "gpukit-bob", "command": "python train.py"}]}))
    setup_shared(world)
    holder = Holder(world.bob, {"gpus": [0], "share": True}, env=dict(world.env))
    holder.wait_claimed()
    _as_root_clean(world, 0)
    out = [("claim_gpus", _stolen_or(judge(as_alice(world, _claim, gpus=[0]), names="gpukit-bob")))]
    os.unlink(world.claims / f"{UUIDS[0]}.lock")  # an administrator's mistake
    _as_root_clean(world, 0)
    out.append(("claim_gpus after the lock file was removed",
                _stolen_or(judge(as_alice(world, _claim, gpus=[0]), names="gpukit-bob"))))
    holder.release()
    return out


def _stolen_or(outcome: str) -> str:
    return "claim stolen" if outcome == "correct" else outcome


def escapes_in_notes_and_commands(world: World) -> Result:
    """Bob's run id and his process's command line hold terminal escape sequences; alice looks."""
    evil = "\x1b]0;owned\x07\x1b[2J\x1b[31mrun"
    world.write_spec(_spec({1: [{"pid": 4243, "user": "gpukit-bob", "command": f"python {evil}"}]}))
    setup_shared(world)
    holder = Holder(world.bob, {"gpus": [0], "run": evil}, env=dict(world.env))
    holder.wait_claimed()
    shows = lambda o: "run" in o.stdout  # noqa: E731 - something was shown
    out = [("gpukit ls", judge(as_alice(world, cli, "ls"), cli_run=True, check=shows)),
           ("gpukit select", judge(as_alice(world, cli, "select", "-n", "4"), cli_run=True)),
           ("gpukit doctor", judge(as_alice(world, cli, "doctor"), check=lambda o: o.value in (0, 1)))]
    holder.release()
    return out


def junk_in_the_queue(world: World) -> Result:
    """Bob fills the queue with junk (dead, malformed, impossible and oversized tickets, a FIFO and a
    /dev/zero symlink named like tickets) and holds a malformed one alive; alice waits for a GPU."""
    setup_shared(world)
    keeper = start_as(world.bob, _hold_junk_tickets, str(world.claims), env=dict(world.env))
    ready = _wait_file(world.claims / "ticket.bob-live")
    out = [("claim_gpus --wait", judge(as_alice(world, _claim, count=1, wait=True, timeout_s=20,
                                                poll_interval_s=0.05), check=lambda o: len(o.value) == 1)
            if ready else "wrong"),
           ("gpukit ls", judge(as_alice(world, cli, "ls"), cli_run=True))]
    keeper.kill()
    keeper.wait(10)
    return out


def _wait_file(path: Path, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.lexists(path):
            return True
        time.sleep(0.01)
    return False


def _hold_junk_tickets(folder: str) -> None:
    import fcntl

    def ticket(name: str, body: bytes, live: bool) -> int | None:
        fd = os.open(os.path.join(folder, ".tmp." + name), os.O_CREAT | os.O_RDWR, 0o644)
        os.write(fd, body)
        if live:
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(os.path.join(folder, ".tmp." + name), os.path.join(folder, name))
        if not live:
            os.close(fd)
            return None
        return fd

    keep = [ticket("ticket.dead", b'{"v": 1, "count": 1}', False),
            ticket("ticket.bad-json", b"{" * 100_000, True),
            ticket("ticket.too-many", json.dumps({"v": 1, "count": 10**6}).encode(), True),
            ticket("ticket.huge", b" " * (1 << 20), True),
            ticket("ticket.within-junk", json.dumps({"v": 1, "count": 1, "within": [{"a": 1}]}).encode(), True)]
    os.symlink("/dev/zero", os.path.join(folder, "ticket.zero"))
    _mkfifo(os.path.join(folder, "ticket.fifo"))
    ticket("ticket.bob-live", json.dumps({"v": 1, "count": 1, "poll_s": 1e300}).encode(), True)
    signal.pause()
    del keep


def stalled_ticket_at_the_head(world: World) -> Result:
    """Bob holds a valid ticket at the head of the queue and never claims: alice's waiter passes it over."""
    setup_shared(world)
    keeper = start_as(world.bob, _hold_valid_ticket, str(world.claims), env=dict(world.env))
    if not _wait_file(world.claims / "ticket.bob-stalls"):
        keeper.kill()
        return [("claim_gpus --wait", "wrong")]
    import gpukit.devices._queue as queue

    saved, queue.STALL_MIN_S = queue.STALL_MIN_S, 0.5  # inherited by alice's forked process
    try:
        started = time.monotonic()
        outcome = as_alice(world, _claim, count=4, wait=True, timeout_s=20, poll_interval_s=0.02)
        waited = time.monotonic() - started
    finally:
        queue.STALL_MIN_S = saved
    keeper.kill()
    keeper.wait(10)
    # it must wait for the grace (the head is honoured at first), then go ahead
    return [("claim_gpus --wait", judge(outcome, check=lambda o: len(o.value) == 4 and waited >= 0.5))]


def _hold_valid_ticket(folder: str) -> None:
    import fcntl

    path = os.path.join(folder, ".tmp.bob")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps({"v": 1, "count": 4, "poll_s": 0.01}).encode())
    os.rename(path, os.path.join(folder, "ticket.bob-stalls"))
    signal.pause()


def bob_tampers_with_alices_ticket(world: World) -> Result:
    """Alice waits (bob holds every GPU); bob tries to remove her ticket and to queue ahead of her with
    a back-dated one; when bob frees a GPU, alice gets it."""
    setup_shared(world)
    hog = Holder(world.bob, {"count": 4}, env=dict(world.env))
    hog.wait_claimed()
    waiter = start_as(world.alice, functools.partial(_claim, count=1, wait=True, timeout_s=30,
                                                     poll_interval_s=0.02), env=dict(world.env))
    if not _wait_for_ticket(world.claims, world.alice.uid):
        waiter.kill()
        hog.release()
        return [("claim_gpus --wait", "wrong")]
    tampered = as_bob(world, _tamper_tickets, str(world.claims), world.alice.uid)
    late = Holder(world.bob, {"count": 1, "wait": True, "timeout_s": 30, "poll_interval_s": 0.02},
                  env=dict(world.env))  # bob also waits now, after alice
    hog.release()  # 4 GPUs free: alice first
    outcome = waiter.wait(30)
    late.wait_claimed(30)
    late.release()
    ok = tampered.kind == "ok" and tampered.value == "refused"
    return [("claim_gpus --wait", judge(outcome, check=lambda o: len(o.value) == 1) if ok else "wrong")]


def _wait_for_ticket(folder: Path, uid: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for entry in os.scandir(folder):
            if entry.name.startswith("ticket.") and entry.stat(follow_symlinks=False).st_uid == uid:
                return True
        time.sleep(0.01)
    return False


def _tamper_tickets(folder: str, victim: int) -> str:
    for entry in os.scandir(folder):
        if entry.name.startswith("ticket.") and entry.stat(follow_symlinks=False).st_uid == victim:
            path = os.path.join(folder, entry.name)
            for attempt in (lambda: os.unlink(path), lambda: os.rename(path, path + ".x")):
                try:
                    attempt()
                    return "removed"
                except PermissionError:
                    pass
    fd = os.open(os.path.join(folder, ".tmp.jump"), os.O_CREAT | os.O_RDWR, 0o644)
    import fcntl

    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps({"v": 1, "count": 1}).encode())
    os.utime(fd, (0, 0))  # back-dated mtime: the order is the kernel's ctime, which cannot be set back
    os.rename(os.path.join(folder, ".tmp.jump"), os.path.join(folder, "ticket.0000-jump"))
    os.close(fd)  # (a live process would keep it; released, it counts for nothing anyway)
    return "refused"


def bob_cannot_reach_alices_private_folder(world: World) -> Result:
    """No shared folder: alice's claims go to her own 0700 folder; bob can neither read nor plant there."""
    outcome = as_alice(world, _claim, count=1)
    folder = str(world.tmp / f"gpukit-claims-{world.alice.uid}")
    planted = as_bob(world, _plant_links, folder, str(world.secret), ["x.lock"])
    ok = planted.kind == "ok" and planted.value == 0 and os.path.isdir(folder)
    return [("claim_gpus", judge(outcome, check=lambda o: len(o.value) == 1 and ok))]


def _file_check(world: World, before: tuple[Any, ...], out: Result) -> Result:
    if world.fingerprint() != before:
        return [(reader, "file changed") for reader, _ in out]
    return out


PROBES: dict[str, Callable[[World], Result]] = {fn.__name__: fn for fn in (
    bob_owns_the_shared_folder, bob_premakes_a_0755_folder, bob_premakes_alices_own_folder,
    symlinks_at_alices_note_names, bob_removes_a_held_lock, bob_plants_lock_files,
    bob_plants_special_files_in_alices_folder, planted_claim_is_reported_and_cleaned, clean_keeps_a_gpu_in_use,
    escapes_in_notes_and_commands, junk_in_the_queue, stalled_ticket_at_the_head, bob_tampers_with_alices_ticket,
    bob_cannot_reach_alices_private_folder,
)}


def run_probe(name: str, alice: User, bob: User) -> Result:
    """Build a fresh world, run one probe in it, remove the world."""
    from gpukit.devices import _claim_dir, _nvml

    world = make_world(alice, bob)
    saved_system, saved_env = _claim_dir.SYSTEM_CLAIM_DIR, dict(os.environ)
    _claim_dir.SYSTEM_CLAIM_DIR = world.base / "system"  # no machine-wide folder unless a probe makes one
    os.environ.pop("GPUKIT_CLAIM_DIR", None)
    try:
        return PROBES[name](world)
    finally:
        _claim_dir.SYSTEM_CLAIM_DIR = saved_system
        os.environ.clear()
        os.environ.update(saved_env)
        _nvml.shutdown()
        shutil.rmtree(world.base, ignore_errors=True)
        for per_user in (f"gpukit-claims-{alice.uid}", f"gpukit-claims-{bob.uid}"):
            shutil.rmtree(Path("/tmp") / per_user, ignore_errors=True)
