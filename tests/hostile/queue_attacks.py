"""Attacks on the fair queue by a second, unfriendly user (issue 26): junk tickets, a ticket that never
claims, removing or out-dating another user's ticket. The world and the outcomes: ``_multiuser_world.py``."""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from pathlib import Path

from _multiuser_world import Result, World, _claim, _mkfifo, as_alice, as_bob, judge, setup_shared
from other_users import Holder, cli, start_as


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
    """Alice waits (bob holds every GPU); bob tries to remove or hard-link her ticket and to queue ahead
    of her with a back-dated one; when bob frees a GPU, alice gets it."""
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
            # a new hard link would reset the ticket's change time (the queue's order): the kernel's
            # fs.protected_hardlinks refuses it (gpukit doctor warns where it is off)
            for attempt in (lambda: os.unlink(path), lambda: os.rename(path, path + ".x"),
                            lambda: os.link(path, os.path.join(folder, "ticket.bob-relink"))):
                try:
                    attempt()
                    return "removed or relinked"
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
