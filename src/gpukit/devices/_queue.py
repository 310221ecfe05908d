"""The fair queue: waiters take tickets, and a freed GPU goes to the oldest waiter it helps.

**Tickets.** A waiter (``claim_gpus(wait=True)``, ``gpukit run --wait``) writes its request to a
fresh ``O_EXCL`` file with an unpredictable name, takes ``flock`` on it, and only then renames it
to ``ticket.<random>`` in the claim folder. So a visible ticket is locked for as long as its
waiter lives, and the kernel unlocks it the moment the waiter dies (SIGKILL included): a dead
waiter leaves the queue at once, whatever files it leaves behind (its own account's next waiter,
or ``gpukit claims clean``, removes them). A ticket nobody holds locked is ignored.

**Order.** Tickets are ordered by the inode's change time (``st_ctime``), which the kernel sets
when the ticket is renamed into the folder and which no user can set back: nobody can queue ahead
of a waiter that was already there (another user's hard link would reset it, which the kernel's
``fs.protected_hardlinks`` forbids; ``_claims_admin.kernel_problem`` warns where it is off). The
kernel's clock for it ticks every few milliseconds, so tickets renamed within one tick are ordered
by the time their waiters wrote into them (believed only within 50 ms of the change time), then
by name.

**The rule.** Each waiter looks at the live tickets older than its own, oldest first. Each of them
reserves, of the GPUs that are free now and that its request can use, as many as it wants (the
best by its own order). A waiter -- and a claim that does not wait -- may take only GPUs that no
older ticket reserved. So while someone waits, a freed GPU goes to the oldest waiter it helps;
a younger waiter backfills only with GPUs no older waiter can use now (not among its GPUs, too
little free memory, ...) or that are left once every older waiter has reserved all it asked
for. Requests by count alone are served first come, first served: a job waiting for 4 GPUs
starts as soon as the jobs of other users running when it arrived have ended. A GPU that an
older waiter cannot use *now* but could later (its memory is freed) may be taken by a younger
one meanwhile.

**No hostages.** No single user can stop others for longer than one bounded wait, because a
ticket reserves nothing when

* its request is *impossible*: fewer GPUs exist on this machine that it could ever use (among
  its GPUs, with enough memory in all) than it asks for;
* it *waits for itself*: fewer than it asks for are free or held by other accounts -- the rest
  are claimed by its own account, or run its own account's processes (a user who holds GPU 0 and
  waits for all 8 would otherwise hold the other 7 back until they give GPU 0 up). GPUs its own
  waiter holds (the process the kernel says holds the ticket) count as coming: it is taking them,
  one by one, before it leaves the queue; if that state lasts, the ticket is passed over as a
  stalled one;
* it has reserved *past the bound*: a ticket that is still short of GPUs stops holding back the
  ones it has found :data:`RESERVE_MAX_S` after it joined the queue (the kernel's change time,
  the same for everyone). It keeps its place and still starts as soon as enough are free at once;
* it *stalls*: its GPUs have all been free for :func:`stall_after_s` (at most
  ``STALL_MIN_S`` to :data:`STALL_MAX_S`) without its waiter taking them. A waiter polls at least
  three times within that time. A claim that does not wait and finds GPUs held back only by such
  a ticket watches it for that long (no more) before passing it over.

**Tampering.** A ticket is read like any file another user wrote: ``O_NOFOLLOW``, regular files
only, 16 KiB at most, every field checked; a malformed ticket, one asking for more GPUs than
this machine has, or a symlink/FIFO named like a ticket is ignored (and said by ``gpukit ls``).
A hand-made live ticket is bound by the rules above like any other: its owner can hold GPUs back
for one bounded wait, not for ever. ``sudo gpukit claims setup`` removes every ticket made
before it took a folder over.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

from gpukit._util.host import host_name
from gpukit._util.safe_files import (
    UnsafeEntry, create_entry, open_entry, read_bounded, try_flock, user_name,
)
from gpukit.devices._claim_dir import ClaimFolder
from gpukit.devices._criteria import ORDERS, Criteria, failures, rank
from gpukit.devices._snapshot import GpuSnapshot

__all__ = ["MAX_ENTRIES", "RESERVE_MAX_S", "QueuedTicket", "Ticket", "read_queue", "reserve", "stall_after_s",
           "waiter_interval_s"]

_PREFIX = "ticket."
_TICKET_MAX_BYTES = 16384
_MAX_WITHIN = 1024
#: A claim folder holding more entries than this is refused (flooded); `gpukit claims clean` empties it.
MAX_ENTRIES = 100_000
STALL_MIN_S = 10.0
#: The longest a ticket may leave GPUs it could take untaken, whatever poll interval it claims.
STALL_MAX_S = 30.0
#: How long after joining the queue a ticket that is short of GPUs may hold back the ones it found.
RESERVE_MAX_S = 1800.0


def stall_after_s(poll_s: float) -> float:
    """How long a ticket may leave GPUs it could take untaken before others pass it over
    (``STALL_MIN_S``..``max(STALL_MIN_S, STALL_MAX_S)``; ten of its polls in between)."""
    return max(STALL_MIN_S, min(10 * poll_s, STALL_MAX_S))


def waiter_interval_s(poll_s: float, ahead: int) -> float:
    """How long a waiter ``ahead`` places back pauses between looks: far back, GPUs come later, so
    it looks less often (at most 5x ``poll_s``), but always at least 3 times per :func:`stall_after_s`
    (so that a waiter which could start is never taken for a stalled one)."""
    return min(poll_s * (1 + min(ahead, 16) / 4), stall_after_s(poll_s) / 3)


@dataclass
class QueuedTicket:
    """A live ticket as read from the folder (every field checked)."""

    name: str
    uid: int
    user: str
    key: tuple[int, int, str]  # (ctime ns, the waiter's own time within a tick, name): queue order
    count: int
    within: frozenset[str] | None  # UUIDs it may use (None: any)
    criteria: Criteria
    order: str
    poll_s: float
    pid: int | None
    run: str | None
    since: float = field(default=0.0)  # ctime, seconds since the epoch
    lock_pid: int | None = None  # the process holding the ticket's flock (the kernel's word: its waiter)
    inode: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the ticket file

    def accepts(self, unit: GpuSnapshot) -> bool:
        return self.could_use(unit) and not failures(unit, self.criteria, self.user)

    def could_use(self, unit: GpuSnapshot) -> bool:
        """Whether ``unit`` could ever serve this ticket: among its GPUs, with enough memory in all."""
        need = self.criteria.min_free_memory_bytes
        return (unit.uuid is not None and (self.within is None or unit.uuid in self.within) and unit.usable
                and (need is None or unit.memory_total_bytes is None or unit.memory_total_bytes >= need))

    def kept_by_itself(self, unit: GpuSnapshot, free: set[str], holders: dict[str, tuple[int | None, int | None]]
                       ) -> bool:
        """Whether this ticket's own account keeps ``unit`` from it: claims it (from another process
        than its waiter: see :meth:`taking`), or runs processes on a free GPU that fails its criteria."""
        if unit.uuid not in free:
            return holders.get(unit.uuid or "", (None, None))[0] == self.uid and not self.taking(unit, holders)
        return not self.accepts(unit) and any(p.user is not None and p.user == self.user for p in unit.processes)

    def taking(self, unit: GpuSnapshot, holders: dict[str, tuple[int | None, int | None]]) -> bool:
        """Whether this ticket's waiter itself holds ``unit``: it is taking its GPUs (one by one, for
        milliseconds, before it leaves the queue)."""
        return self.lock_pid is not None and holders.get(unit.uuid or "", (None, None))[1] == self.lock_pid


def request_of(count: int, within: set[str] | None, criteria: Criteria, order: str, poll_s: float,
               run: str | None = None) -> dict[str, Any]:
    """The JSON a ticket holds."""
    return {"v": 1, "count": count, "within": None if within is None else sorted(within),
            "min_free_bytes": criteria.min_free_memory_bytes, "max_util_pct": criteria.max_utilization_pct,
            "max_procs": criteria.max_processes, "share": criteria.share, "order": order,
            "poll_s": poll_s, "pid": os.getpid(), "host": host_name(), "run": run}


_TIE_NS = 50_000_000  # how far a waiter's own time may stray from the kernel's ctime (a tie-break only)


def _order_key(ctime_ns: int, written_ns: Any, name: str) -> tuple[int, int, str]:
    if isinstance(written_ns, bool) or not isinstance(written_ns, int):
        written_ns = ctime_ns
    return ctime_ns, min(max(written_ns, ctime_ns - _TIE_NS), ctime_ns + _TIE_NS), name


class Ticket:
    """This process's place in the queue, held until :meth:`close` (or until it exits)."""

    def __init__(self, folder: ClaimFolder, request: dict[str, Any]) -> None:
        import secrets

        self.folder = folder
        temp = f".tmp.{secrets.token_hex(16)}"
        self.name = f"{_PREFIX}{secrets.token_hex(16)}"
        self.fd = create_entry(folder.fd, temp, 0o644)
        try:
            try_flock(self.fd)  # a fresh file: nobody else can hold it
            os.write(self.fd, json.dumps({**request, "t_ns": time.time_ns()}).encode())
            os.rename(temp, self.name, src_dir_fd=folder.fd, dst_dir_fd=folder.fd)
        except BaseException:
            os.close(self.fd)
            try:
                os.unlink(temp, dir_fd=folder.fd)
            except OSError:
                pass
            raise
        written = json.loads(os.pread(self.fd, _TICKET_MAX_BYTES, 0))["t_ns"]
        self.key = _order_key(os.fstat(self.fd).st_ctime_ns, written, self.name)

    def close(self) -> None:
        """Leave the queue: remove the ticket, then unlock it (so no live waiter's ticket is ever unlocked)."""
        if self.fd < 0:
            return
        try:
            os.unlink(self.name, dir_fd=self.folder.fd)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _number(value: Any, low: float, high: float) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError
    if not low <= value <= high:
        raise ValueError
    return value


def _parse(raw: bytes, units: int) -> dict[str, Any]:
    data = json.loads(raw)
    if not isinstance(data, dict) or data.get("v") != 1:
        raise ValueError
    count = data.get("count")
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= max(units, 1):
        raise ValueError  # more than this machine has: it could never start, so it reserves nothing
    within = data.get("within")
    if within is not None:
        if not isinstance(within, list) or len(within) > _MAX_WITHIN or not all(
                isinstance(u, str) and 0 < len(u) <= 100 for u in within) or len(set(within)) < count:
            raise ValueError
        within = frozenset(within)
    optional = {key: None if data.get(key) is None else _number(data[key], 0, high)
                for key, high in (("min_free_bytes", 1 << 60), ("max_util_pct", 100), ("max_procs", 1 << 20))}
    if optional["max_procs"] is not None and not isinstance(data["max_procs"], int):
        raise ValueError
    share, order = data.get("share", False), data.get("order", "free-memory")
    if not isinstance(share, bool) or order not in ORDERS:
        raise ValueError
    poll_s = _number(data.get("poll_s", 1.0), 0.0, 1e9) or 0.0
    pid, run = data.get("pid"), data.get("run")
    return {"written_ns": data.get("t_ns"), "count": count, "within": within, "order": order, "poll_s": min(max(poll_s, 0.01), 60.0),
            "criteria": Criteria(None if optional["min_free_bytes"] is None else int(optional["min_free_bytes"]),
                                 optional["max_util_pct"], None if optional["max_procs"] is None
                                 else int(optional["max_procs"]), (), None, share),
            "pid": pid if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 1 << 31 else None,
            "run": run[:200] if isinstance(run, str) else None}


def read_queue(folder: ClaimFolder, units: int) -> tuple[list[QueuedTicket], list[str]]:
    """The live tickets, oldest first, and what was ignored and why (for ``gpukit ls``/doctor).

    Dead tickets of this account are removed on the way. ``units``: how many GPUs (or MIG
    devices) this machine has; a ticket asking for more is ignored.

    Raises:
        OverflowError: the folder holds more than :data:`MAX_ENTRIES` entries.
    """
    live: list[QueuedTicket] = []
    ignored: list[str] = []
    me = os.geteuid()
    with os.scandir(folder.fd) as entries:
        for seen, entry in enumerate(entries):
            if seen >= MAX_ENTRIES:
                raise OverflowError(f"the claim folder {folder.path} holds more than {MAX_ENTRIES} entries")
            if entry.name.startswith(_PREFIX):
                ticket = _read_one(folder, entry.name, units, me, ignored)
                if ticket is not None:
                    live.append(ticket)
    if live:
        from gpukit.devices._claim_files import flock_holders

        kernel = flock_holders() or {}
        for ticket in live:
            ticket.lock_pid = kernel.get(ticket.inode)
    live.sort(key=lambda t: t.key)
    return live, ignored


def _read_one(folder: ClaimFolder, name: str, units: int, me: int, ignored: list[str]) -> QueuedTicket | None:
    try:
        fd, info = open_entry(folder.fd, name)
    except UnsafeEntry as exc:
        ignored.append(f"{name}: {exc.kind} made by {user_name(exc.owner_uid)}")
        return None
    except OSError:
        return None
    try:
        if try_flock(fd, exclusive=False):  # nobody holds it: its waiter is gone
            if info.st_uid == me:
                try:
                    os.unlink(name, dir_fd=folder.fd)
                except OSError:
                    pass
            return None
        raw = read_bounded(fd, _TICKET_MAX_BYTES)
    finally:
        os.close(fd)
    user = user_name(info.st_uid)
    try:
        if raw is None:
            raise ValueError
        fields = _parse(raw, units)
    except (ValueError, RecursionError, TypeError):
        ignored.append(f"{name}: a malformed or impossible ticket of {user}")
        return None
    key = _order_key(info.st_ctime_ns, fields.pop("written_ns"), name)
    return QueuedTicket(name, info.st_uid, user, key, since=info.st_ctime_ns / 1e9, inode=(info.st_dev, info.st_ino),
                        **fields)


def reserve(older: list[QueuedTicket], units: list[GpuSnapshot], free: set[str], stalls: dict[str, float],
            now: float | None = None, holders: dict[str, tuple[int | None, int | None]] | None = None,
            wall_now: float | None = None) -> dict[str, str]:
    """UUID -> why it is reserved, for the GPUs ``older`` tickets (oldest first) hold back
    (the rule and its bounds: the module docstring).

    ``free``: UUIDs nobody holds now. ``stalls``: the caller's memory, between calls, of since when
    each ticket could have taken its GPUs (monotonic seconds). ``holders``: UUID -> ``(uid, pid)`` of
    the claim's holder (``None``: unknown), for GPUs not free. ``wall_now``: the time to age tickets by.
    """
    now = time.monotonic() if now is None else now
    wall_now = time.time() if wall_now is None else wall_now
    holders = {} if holders is None else holders
    available = set(free)
    reserved: dict[str, str] = {}
    for position, ticket in enumerate(older, 1):
        possible = [u for u in units if ticket.could_use(u)]
        coming = [u for u in possible if not ticket.kept_by_itself(u, free, holders)]
        if len(coming) < ticket.count:
            stalls.pop(ticket.name, None)
            continue  # impossible, or waiting for what its own account keeps: it holds nothing back
        usable = rank([u for u in units if u.uuid in available and ticket.accepts(u)], ticket.order)
        mine = usable[:ticket.count]
        # its waiter taking its GPUs is a moment's state: held back as if it could start, and passed
        # over like a stalled ticket if it lasts (a process that holds GPUs and a ticket for ever)
        if len(mine) == ticket.count or any(ticket.taking(u, holders) for u in possible):
            first = stalls.setdefault(ticket.name, now)
            if now - first > stall_after_s(ticket.poll_s):
                continue  # could have started long ago and did not: passed over
        else:
            stalls.pop(ticket.name, None)
            if wall_now - ticket.since > RESERVE_MAX_S:
                continue  # short of GPUs for longer than the bound: it keeps its place, holds nothing back
        plural = "GPU" if ticket.count == 1 else "GPUs"
        why = (f"reserved for an older waiter in the queue (#{position}: {ticket.user}, {ticket.count} {plural}, "
               f"waiting {_age(ticket.since)})")
        for unit in mine:
            reserved[unit.uuid or ""] = why
            available.discard(unit.uuid or "")
    return reserved


def _age(since: float) -> str:
    seconds = max(0.0, time.time() - since)
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def busy_units(folder: ClaimFolder, gpus: list[GpuSnapshot], mine: Ticket | None = None,
               stalls: dict[str, float] | None = None) -> tuple[dict[str, str], int, set[str]]:
    """UUID -> why another job has it now: claimed (the kernel's lock), or reserved for a waiter
    older than ``mine`` (``None``: every waiter is older, as for a claim that does not wait); how
    many live waiters are older than ``mine``; and which of the busy UUIDs are only reserved.

    Raises:
        DeviceError: the folder is flooded with entries (names the fix).
    """
    from gpukit.devices._claim_files import claim_owners, holder_text
    from gpukit.devices._snapshot import selectable_units
    from gpukit.errors import DeviceError

    units = [u for u in selectable_units(gpus) if u.uuid is not None]
    try:  # the queue before the holders: a waiter claims its GPUs before it drops its ticket, so a
        # ticket gone by now has its GPUs among the holders read next (the other order let a waiter
        # that had just claimed count as neither, and a younger one took the GPU an older one needed)
        tickets, _ignored = read_queue(folder, len(units))
    except OverflowError as exc:
        from gpukit.devices._claims_clean import is_claim_folder

        if is_claim_folder(folder):
            fix = ("an administrator can empty it with `sudo gpukit claims clean`, which removes everything that "
                   "is not gpukit's")
        elif folder.shared:
            fix = ("an administrator can empty it with `sudo gpukit claims setup` (which marks it as gpukit's "
                   "shared folder), then `sudo gpukit claims clean`, which removes everything that is not gpukit's")
        else:
            fix = ("remove what does not belong there (`gpukit claims clean` removes gpukit's own leftovers), or set "
                   "GPUKIT_CLAIM_DIR to a folder of its own")
        raise DeviceError(f"GPU claims: {exc}, more than any queue needs (another user flooding it?); {fix}.") from None
    holders = claim_owners([u.uuid or "" for u in units], folder=folder)
    busy = {uuid: holder_text(owner) for uuid, owner in holders.items()}
    older = [t for t in tickets if mine is None or t.key < mine.key]
    free = {u.uuid or "" for u in units if u.uuid not in holders}
    who = {uuid: (None, None) if owner is None else (owner.get("uid"), owner.get("pid")) for uuid, owner in holders.items()}
    reserved = reserve(older, units, free, {} if stalls is None else stalls, holders=who)
    busy.update(reserved)
    return busy, len(older), set(reserved)
