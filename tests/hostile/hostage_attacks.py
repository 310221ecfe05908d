"""Attacks that try to hold the shared machine hostage, and the administrator's tools against them
(issue 41 items 1-5): a waiter that waits for what it holds, a ticket planted before ``claims setup``,
a flood of junk, a lock kept by an orphaned child, a live claim ``claims clean`` must keep, a symlink
planted as a parent of the folder ``claims setup`` makes. The world and the outcomes:
``_multiuser_world.py``."""

from __future__ import annotations

import functools
import json
import os
import signal
import time

from _multiuser_world import UUIDS, Result, World, _claim, _make_folder, as_alice, as_bob, judge, setup_shared
from other_users import Holder, Outcome, cli, run_as, start_as


def waiter_holding_what_it_waits_for(world: World) -> Result:
    """Bob holds GPU 0 and waits for all 4 (`gpukit run --gpus 4 --wait`): the 3 free GPUs must not be
    held back for him; alice's claim without --wait gets one at once."""
    setup_shared(world)
    hog = Holder(world.bob, {"gpus": [0]}, env=dict(world.env))
    hog.wait_claimed()
    waiter = Holder(world.bob, {"count": 4, "wait": True, "timeout_s": 60, "poll_interval_s": 0.05},
                    env=dict(world.env))
    if not _wait_for_ticket(world, world.bob.uid):
        waiter.kill()
        hog.release()
        return [("claim_gpus", "wrong")]
    started = time.monotonic()
    outcome = as_alice(world, _claim, count=1)
    waited = time.monotonic() - started
    waiter.kill()
    hog.release()
    return [("claim_gpus", judge(outcome, check=lambda o: len(o.value) == 1 and UUIDS[0] not in o.value
                                 and waited < 15, expect="correct"))]


def ticket_planted_before_setup(world: World) -> Result:
    """Bob makes the claim folder first and plants a live ticket for all 4 GPUs; then the administrator
    runs `claims setup`, which must remove it: alice's claim without --wait gets a GPU at once."""
    world.claims = world.tmp / "claims"  # where bob can make it first
    as_bob(world, _make_folder, str(world.claims), 0o1777)
    keeper = start_as(world.bob, _hold_ticket, str(world.claims), env=dict(world.env))
    if not _wait_for_ticket(world, world.bob.uid):
        keeper.kill()
        keeper.wait(10)
        return [("claim_gpus", "wrong")]
    setup_shared(world)
    outcome = as_alice(world, _claim, count=1)
    keeper.kill()
    keeper.wait(10)
    return [("claim_gpus", judge(outcome, check=lambda o: len(o.value) == 1, expect="correct"))]


def hand_made_ticket_and_a_claim_that_does_not_wait(world: World) -> Result:
    """Bob holds a hand-made live ticket for all 4 GPUs claiming a 60 s poll, and never claims: alice's
    claim without --wait honours it for the stall bound (shortened here), then takes a GPU -- it was
    refused for ever before."""
    import gpukit.devices._queue as queue

    setup_shared(world)
    keeper = start_as(world.bob, _hold_ticket, str(world.claims), env=dict(world.env))
    if not _wait_for_ticket(world, world.bob.uid):
        keeper.kill()
        keeper.wait(10)
        return [("claim_gpus", "wrong")]
    saved = queue.STALL_MIN_S, queue.STALL_MAX_S
    queue.STALL_MIN_S = queue.STALL_MAX_S = 1.0  # inherited by alice's forked process
    try:
        started = time.monotonic()
        outcome = as_alice(world, _claim, count=1)
        waited = time.monotonic() - started
    finally:
        queue.STALL_MIN_S, queue.STALL_MAX_S = saved
        keeper.kill()
        keeper.wait(10)
    return [("claim_gpus", judge(outcome, check=lambda o: len(o.value) == 1 and 1.0 <= waited < 20,
                                 expect="correct"))]


def _hold_ticket(folder: str) -> None:
    import fcntl

    path = os.path.join(folder, ".tmp.bob")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps({"v": 1, "count": 4, "poll_s": 60}).encode())
    os.rename(path, os.path.join(folder, f"ticket.bob-{os.getpid()}"))
    signal.pause()


def _wait_for_ticket(world: World, uid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            for entry in os.scandir(world.claims):
                if entry.name.startswith("ticket.") and entry.stat(follow_symlinks=False).st_uid == uid:
                    return True
        except OSError:
            pass
        time.sleep(0.01)
    return False


def flood_of_junk(world: World) -> Result:
    """Bob fills the shared folder with 100,001 junk files: alice's claim is refused, saying the fix;
    root's `gpukit claims clean` (the advised fix) removes them, and alice's claim then works."""
    from gpukit.devices._queue import MAX_ENTRIES

    setup_shared(world)
    flooded = run_as(world.bob, functools.partial(_flood, str(world.claims), MAX_ENTRIES + 1), env=dict(world.env),
                     timeout_s=600)
    if flooded.kind != "ok":
        return [("claim_gpus", judge(flooded))]
    out = [("claim_gpus", judge(as_alice(world, _claim, count=1), check=lambda o: False,
                                names="sudo gpukit claims clean"))]
    code = cli("claims", "clean", "--dir", str(world.claims))  # root, as the message advises
    left = len(os.listdir(world.claims))
    out.append(("claim_gpus after claims clean", judge(as_alice(world, _claim, count=1),
                                                       check=lambda o: code == 0 and left <= 8, expect="correct")))
    return out


def _flood(folder: str, count: int) -> None:
    for i in range(count):
        os.close(os.open(os.path.join(folder, f"junk.{i}"), os.O_CREAT | os.O_WRONLY, 0o644))


def lock_kept_by_an_orphaned_child(world: World) -> Result:
    """Bob's job claims GPU 0, forks a child that keeps the lock open, and exits. Alice's `gpukit ls`
    must say that the pid that took it has exited and whose it was (bob's: she may not look into his
    processes); root's `claims clean` names the live holder (the child) and keeps it;
    `claims clean --force` frees it; then alice gets GPU 0."""
    setup_shared(world)
    read_end, write_end = os.pipe()
    parent = run_as(world.bob, _claim_and_orphan, write_end, env=dict(world.env))
    os.close(write_end)
    child = int(os.read(read_end, 64) or b"0")
    os.close(read_end)
    try:
        if parent.kind != "ok" or child <= 0:
            return [("gpukit ls", judge(parent))]
        shown = as_alice(world, cli, "ls")
        out = [("gpukit ls", judge(shown, cli_run=True, check=lambda o: "has exited" in o.stdout
                                   and "gpukit-bob" in o.stdout))]
        kept = _root_clean(world, force=False)
        out.append(("claim_gpus while kept", judge(as_alice(world, _claim, gpus=[0]), names="gpukit-bob")))
        freed = _root_clean(world, force=True)
        named = any(f"pid {child}" in line and "kept" in line for line in kept) and any(
            "freed" in line for line in freed)
        out.append(("claim_gpus after claims clean --force",
                    judge(as_alice(world, _claim, gpus=[0]), check=lambda o: named, expect="correct")))
        return out
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _claim_and_orphan(report_fd: int) -> int:
    from gpukit.devices import claim_gpus

    claim = claim_gpus(gpus=[0])
    claim._locks = [os.dup(fd) for fd in claim._locks]  # noqa: SLF001 - the child keeps the lock file open
    pid = os.fork()
    if pid == 0:
        os.setsid()
        keep = max(claim._locks)  # noqa: SLF001
        for fd in range(3, 4096):  # the test's pipes must see their end
            if fd != keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
        signal.pause()
        os._exit(0)
    os.write(report_fd, str(pid).encode())
    return pid  # exits at once: the kernel's /proc/locks still names this pid


def _root_clean(world: World, *, force: bool) -> list[str]:
    from gpukit.devices import _nvml, list_gpus
    from gpukit.devices._claim_dir import open_claim_folder
    from gpukit.devices._claims_clean import clean_folder

    os.environ["GPUKIT_FAKE_GPUS"] = str(world.spec)
    _nvml.shutdown()
    with open_claim_folder(world.claims, create=False) as folder:
        return clean_folder(folder, list_gpus(), older_than_s=0, force=force)


def setup_through_a_planted_parent(world: World) -> Result:
    """Bob plants a symlink to a folder of his where a parent of the folder `claims setup --dir` makes
    should be: root must refuse (naming bob), not make a world-writable folder in bob's place."""
    theirs = world.base / "bobs"
    theirs.mkdir()
    os.chown(theirs, world.bob.uid, world.bob.gid)
    as_bob(world, os.symlink, str(theirs), str(world.tmp / "x"))
    code, said = _cli_capture("claims", "setup", "--dir", str(world.tmp / "x" / "claims"))
    made = os.path.lexists(theirs / "claims")
    outcome = Outcome("ok", code, stdout=said)
    return [("sudo gpukit claims setup", judge(outcome, check=lambda o: o.value == 2 and not made
                                               and "gpukit-bob" in o.stdout))]


def _cli_capture(*argv: str) -> tuple[int, str]:
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stderr(buffer), contextlib.redirect_stdout(buffer):
        code = cli(*argv)
    return code, buffer.getvalue()


PROBES = {fn.__name__: fn for fn in (waiter_holding_what_it_waits_for, ticket_planted_before_setup,
                                      hand_made_ticket_and_a_claim_that_does_not_wait, flood_of_junk,
                                      lock_kept_by_an_orphaned_child, setup_through_a_planted_parent)}
