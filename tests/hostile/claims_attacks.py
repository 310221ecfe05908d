"""Attacks on the claim store by a second, unfriendly user of the same machine (issue 26).

Two real unprivileged accounts (``tests/devices/other_users.py``): ``gpukit-bob`` attacks,
``gpukit-alice`` is the victim. Every probe builds its own world (``_multiuser_world.py``: a fake
4-GPU spec, a sticky "temp dir", the victim's private file under a fresh root-owned folder), lets
bob plant his files, runs one or more of alice's gpukit commands (the library or the CLI, in a
process of hers), and says what happened (the outcomes are described there). The queue's attacks
are in ``queue_attacks.py``; :data:`PROBES` holds both. Nothing is committed: every input is made
here, at test time.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import hostage_attacks
import queue_attacks
from _multiuser_world import (
    OUTCOMES, SAFE, UUIDS, Result, World, _claim, _file_check, _ls_json, _make_folder, _mkfifo, _note_names,
    _plant_links, _spec, as_alice, as_bob, judge, make_world, setup_shared,
)
from other_users import Holder, Outcome, User, cli, sticky_folder


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
    """No shared folder: bob makes <tmp>/gpukit-claims-<alice's uid> first. Alice's claims go under her
    own home (issue 41 item 6), so it does not matter; without a home of hers they fall back to that
    temp folder, and the claim is refused naming bob."""
    folder = str(world.tmp / f"gpukit-claims-{world.alice.uid}")
    as_bob(world, _make_folder, folder, 0o777)
    home = world.env["HOME"]
    out = [("claim_gpus", judge(as_alice(world, _claim, count=1), check=lambda o: len(o.value) == 1
                                and os.path.isdir(os.path.join(home, ".cache", "gpukit")), expect="correct"))]
    world.env["HOME"] = "/nonexistent"
    out.append(("claim_gpus without a home", judge(as_alice(world, _claim, count=1), names="gpukit-bob",
                                                   expect="refused cleanly")))
    return out


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


def _as_root_clean(world: World, older_than_s: float, force: bool = False) -> list[str]:
    from gpukit.devices import _nvml, list_gpus
    from gpukit.devices._claim_dir import open_claim_folder
    from gpukit.devices._claims_admin import setup_folder
    from gpukit.devices._claims_clean import clean_folder

    os.environ["GPUKIT_FAKE_GPUS"] = str(world.spec)
    _nvml.shutdown()
    actions = setup_folder(world.claims)
    with open_claim_folder(world.claims, create=False) as folder:
        actions += clean_folder(folder, list_gpus(), older_than_s=older_than_s, force=force)
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
    """Bob holds a claim on GPU 0 and never uses it (a planted claim, or a job still preparing its
    data): alice's ls/doctor name him and its age; root's `gpukit claims clean --older-than 0` keeps
    it (its holder is alive), `--force` frees it, and alice then gets GPU 0."""
    setup_shared(world)
    holder = Holder(world.bob, {"gpus": [0]}, env=dict(world.env))
    holder.wait_claimed()
    import gpukit.devices._claims_clean as admin

    saved, admin.STALE_AFTER_S = admin.STALE_AFTER_S, 0.0  # inherited by alice's processes (forked)
    try:
        out = [("gpukit ls", judge(as_alice(world, cli, "ls"), cli_run=True,
                                   check=lambda o: "stale or planted" in o.stdout and "gpukit-bob" in o.stdout)),
               ("gpukit doctor", judge(as_alice(world, cli, "doctor"),
                                       check=lambda o: "stale or planted" in o.stdout and "gpukit-bob" in o.stdout))]
    finally:
        admin.STALE_AFTER_S = saved
    kept = _as_root_clean(world, 0)
    out.append(("claim_gpus after claims clean", judge(as_alice(world, _claim, gpus=[0]), names="gpukit-bob",
                                                       expect="refused cleanly")))
    actions = _as_root_clean(world, 0, force=True)
    out.append(("claim_gpus after claims clean --force", judge(
        as_alice(world, _claim, gpus=[0]), check=lambda o: o.value == [UUIDS[0]] and any("freed" in a for a in actions)
        and not any("freed" in a for a in kept))))
    holder.release()
    return out


def clean_keeps_a_gpu_in_use(world: World) -> Result:
    """Bob's claim on GPU 0 is old but bob's process runs on it (NVML): clean must leave it, and alice
    must not get GPU 0 -- also after root removed its lock file by hand."""
    world.write_spec(_spec({0: [{"pid": 4242, "user": "gpukit-bob", "command": "python train.py"}]}))
    setup_shared(world)
    holder = Holder(world.bob, {"gpus": [0], "share": True}, env=dict(world.env))
    holder.wait_claimed()
    _as_root_clean(world, 0, force=True)
    out = [("claim_gpus", _stolen_or(judge(as_alice(world, _claim, gpus=[0]), names="gpukit-bob")))]
    os.unlink(world.claims / f"{UUIDS[0]}.lock")  # an administrator's mistake
    _as_root_clean(world, 0, force=True)
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

def bob_cannot_reach_alices_private_folder(world: World) -> Result:
    """No shared folder: alice's claims go to her own 0700 folder; bob can neither read nor plant there."""
    outcome = as_alice(world, _claim, count=1)
    folder = os.path.join(world.env["HOME"], ".cache", "gpukit")  # her own (issue 41 item 6)
    folder = os.path.join(folder, os.listdir(folder)[0]) if os.path.isdir(folder) else folder
    planted = as_bob(world, _plant_links, folder, str(world.secret), ["x.lock"])
    ok = planted.kind == "ok" and planted.value == 0 and os.path.isdir(folder) and os.stat(folder).st_mode & 0o777 == 0o700
    return [("claim_gpus", judge(outcome, check=lambda o: len(o.value) == 1 and ok))]

PROBES: dict[str, Callable[[World], Result]] = {**{fn.__name__: fn for fn in (
    bob_owns_the_shared_folder, bob_premakes_a_0755_folder, bob_premakes_alices_own_folder,
    symlinks_at_alices_note_names, bob_removes_a_held_lock, bob_plants_lock_files,
    bob_plants_special_files_in_alices_folder, planted_claim_is_reported_and_cleaned, clean_keeps_a_gpu_in_use,
    escapes_in_notes_and_commands, bob_cannot_reach_alices_private_folder,
    queue_attacks.junk_in_the_queue, queue_attacks.stalled_ticket_at_the_head,
    queue_attacks.bob_tampers_with_alices_ticket,
)}, **hostage_attacks.PROBES}
__all__ = ["OUTCOMES", "SAFE", "PROBES", "run_probe"]


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
