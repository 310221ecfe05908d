"""The fair queue: who a freed GPU goes to, tickets that die with their waiter, real processes."""

from __future__ import annotations

import json
import os
import random
import select
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from other_users import User, shared_area, unprivileged_users

from gpukit.devices import _nvml, claim_gpus, list_gpus
from gpukit.devices import _queue as queue
from gpukit.devices._claim_dir import open_claim_folder
from gpukit.devices._claims_admin import setup_folder
from gpukit.devices._queue import QueuedTicket, Ticket, read_queue, request_of, reserve
from gpukit.devices._criteria import Criteria, make_criteria
from gpukit.errors import GpuSelectionError

FOUR = {"gpus": [{"name": "Fake A100", "uuid": f"GPU-{i}aaaaaaa-0000-4000-8000-00000000000{i}",
                  "memory_total_mib": 40960, "memory_used_mib": 0, "utilization_gpu_pct": 0} for i in range(4)]}


def _ticket(name: str, count: int, order_key: int, within: set[str] | None = None,
            criteria: Criteria | None = None, poll_s: float = 1.0, uid: int = 0, since: float | None = None
            ) -> QueuedTicket:
    return QueuedTicket(name, uid, "someone", (order_key, 0, name), count, None if within is None else frozenset(within),
                        criteria or Criteria(), "free-memory", poll_s, 1, None,
                        since=time.time() if since is None else since)


def test_the_head_reserves_what_it_can_use_and_younger_waiters_backfill_the_rest(use_spec) -> None:
    use_spec(FOUR)
    units = list_gpus()
    uuids = [u.uuid for u in units]
    free = {uuids[1], uuids[3]}
    # the head wants 4: both free GPUs are held back for it, nothing is left to backfill
    reserved = reserve([_ticket("head", 4, 1)], units, free, {})
    assert set(reserved) == free and "#1: someone, 4 GPUs" in reserved[uuids[1]]
    # a head that wants only GPU 0 and 1 holds back GPU 1; GPU 3 is free for a younger waiter
    reserved = reserve([_ticket("head", 2, 1, within={uuids[0], uuids[1]})], units, free, {})
    assert set(reserved) == {uuids[1]}
    # a head whose criteria GPU 3 fails (too little free memory) does not hold GPU 3 back
    big = make_criteria(min_free_memory="100GiB")
    assert reserve([_ticket("head", 1, 1, criteria=big)], units, free, {}) == {}
    # two older waiters of 1 GPU each take both free GPUs, best first, oldest first
    reserved = reserve([_ticket("a", 1, 1), _ticket("b", 1, 2)], units, free, {})
    assert reserved[uuids[1]].startswith("reserved for an older waiter in the queue (#1")
    assert reserved[uuids[3]].startswith("reserved for an older waiter in the queue (#2")


def test_a_ticket_that_does_not_take_its_gpus_is_passed_over(use_spec) -> None:
    use_spec(FOUR)
    units = list_gpus()
    free = {u.uuid for u in units}
    stalls: dict[str, float] = {}
    head = [_ticket("head", 1, 1, poll_s=0.01)]
    assert len(reserve(head, units, free, stalls, now=100.0)) == 1  # satisfiable from now on
    assert len(reserve(head, units, free, stalls, now=100.0 + queue.STALL_MIN_S - 1)) == 1  # still its turn
    assert reserve(head, units, free, stalls, now=100.0 + queue.STALL_MIN_S + 1) == {}  # passed over
    assert reserve(head, units, set(), stalls, now=200.0) == {} and "head" not in stalls  # not satisfiable: reset


def test_no_ticket_holds_gpus_back_for_longer_than_one_bounded_wait(use_spec) -> None:
    """Issue 41 item 1: an impossible request, a waiter whose own account holds what it waits for,
    and a reservation held past the bound reserve nothing; a hand-made ticket asking for a huge
    poll interval is passed over within STALL_MAX_S."""
    use_spec(FOUR)
    units = list_gpus()
    uuids = [u.uuid for u in units]
    free = set(uuids[1:])
    # uid 1000 holds GPU 0 and waits for all 4: the 3 free ones stay free for others
    assert reserve([_ticket("hostage", 4, 1, uid=1000)], units, free, {}, holders={uuids[0]: (1000, 77)}) == {}
    # the same request while another account holds GPU 0: first come, first served (held back)
    assert set(reserve([_ticket("fair", 4, 1, uid=1000)], units, free, {}, holders={uuids[0]: (2000, 88)})) == free
    # ... but not past the bound: a ticket short of GPUs for longer than RESERVE_MAX_S holds nothing back
    old = time.time() - queue.RESERVE_MAX_S - 1
    assert reserve([_ticket("old", 4, 1, uid=1000, since=old)], units, free, {}, holders={uuids[0]: (2000, 88)}) == {}
    # the waiter itself holds GPU 0 (it is taking its GPUs, one by one): the rest stay held back for it --
    # for a moment; a process that holds a GPU and a ticket for ever is passed over like a stalled one
    taking = _ticket("taking", 4, 1, uid=1000)
    taking.lock_pid = 77
    stalls = {}
    assert set(reserve([taking], units, free, stalls, now=0.0, holders={uuids[0]: (1000, 77)})) == free
    bound = queue.stall_after_s(taking.poll_s)
    assert reserve([taking], units, free, stalls, now=bound + 0.1, holders={uuids[0]: (1000, 77)}) == {}
    # impossible: 2 GPUs among its own list, of which one does not exist here
    assert reserve([_ticket("never", 2, 1, within={uuids[1], "GPU-gone"})], units, free, {}) == {}
    # a full reservation with a huge claimed poll interval: passed over after STALL_MAX_S at most
    stalls: dict[str, float] = {}
    slow = [_ticket("slow", 1, 1, poll_s=60.0)]
    assert len(reserve(slow, units, free, stalls, now=0.0)) == 1
    bound = max(queue.STALL_MIN_S, queue.STALL_MAX_S)
    assert reserve(slow, units, free, stalls, now=bound + 0.1) == {}


def test_a_claim_that_does_not_wait_passes_a_stalled_ticket_after_one_bounded_wait(use_spec, monkeypatch) -> None:
    """A live ticket whose GPUs are free but never taken (a hand-made one): a claim without --wait
    watches it for the stall bound, then takes the GPU (it was refused for ever before)."""
    use_spec(FOUR)
    monkeypatch.setattr(queue, "STALL_MIN_S", 0.5)
    monkeypatch.setattr(queue, "STALL_MAX_S", 0.5)
    folder = open_claim_folder()
    try:
        with Ticket(folder, request_of(4, None, Criteria(), "free-memory", 60.0)):  # never claims
            started = time.monotonic()
            with claim_gpus(1) as claim:
                assert len(claim.gpus) == 1
            assert time.monotonic() - started >= 0.5  # it honoured the ticket first
    finally:
        folder.close()


def test_tickets_are_ordered_by_arrival_and_leave_with_their_waiter(use_spec) -> None:
    use_spec(FOUR)
    folder = open_claim_folder()
    try:
        criteria = Criteria()
        first = Ticket(folder, request_of(1, None, criteria, "free-memory", 0.5))
        second = Ticket(folder, request_of(2, None, criteria, "index", 0.5, run="gpukit-abc"))
        live, ignored = read_queue(folder, 4)
        assert [t.name for t in live] == [first.name, second.name] and ignored == []
        assert (live[1].count, live[1].order, live[1].run, live[1].pid) == (2, "index", "gpukit-abc", os.getpid())
        # a ticket file nobody holds (its waiter was SIGKILLed) is ignored at once, and removed
        # by the next look of its own account
        fd = os.open(first.name, os.O_RDONLY, dir_fd=folder.fd)
        os.close(first.fd)  # the lock goes, the file stays: what a SIGKILL leaves
        first.fd = -1
        live, _ = read_queue(folder, 4)
        assert [t.name for t in live] == [second.name]
        assert not os.path.exists(folder.path / first.name)
        os.close(fd)
        second.close()
        assert read_queue(folder, 4) == ([], [])
    finally:
        folder.close()


def test_junk_named_like_tickets_is_ignored_and_said(use_spec, tmp_path: Path) -> None:
    import fcntl

    use_spec(FOUR)
    folder = open_claim_folder()
    try:
        os.symlink("/dev/zero", folder.path / "ticket.zero")
        os.mkfifo(folder.path / "ticket.fifo")
        os.mkdir(folder.path / "ticket.dir")
        held = []
        for name, body in (("ticket.deep", b"[" * 200_000), ("ticket.huge", b" " * (1 << 20)),
                           ("ticket.many", json.dumps({"v": 1, "count": 5}).encode()),  # more than the 4 GPUs
                           ("ticket.nan", b'{"v": 1, "count": 1, "poll_s": NaN}')):
            fd = os.open(folder.path / name, os.O_CREAT | os.O_RDWR, 0o644)
            os.write(fd, body)
            fcntl.flock(fd, fcntl.LOCK_EX)
            held.append(fd)
        started = time.monotonic()
        live, ignored = read_queue(folder, 4)
        assert live == [] and time.monotonic() - started < 5
        said = "\n".join(ignored)
        assert "ticket.zero: a symlink" in said and "ticket.fifo: a FIFO" in said and "ticket.dir: a directory" in said
        assert all(f"ticket.{n}: a malformed or impossible ticket" in said for n in ("deep", "huge", "many", "nan"))
        for fd in held:
            os.close(fd)
    finally:
        folder.close()


def test_a_claim_that_does_not_wait_leaves_reserved_gpus_alone(use_spec) -> None:
    if os.geteuid() != 0:
        pytest.skip("the waiter must be another account (a ticket waiting for its own account's GPUs holds "
                    "nothing back): chown needs root")
    use_spec(FOUR)
    events, gate_r, gate_w = Events(), *os.pipe()
    holder = _fork(_job(events, "holder", 3, gate_r, 0.05))  # another process holds 3 GPUs
    try:
        assert events.next().startswith("start holder ")
        folder = open_claim_folder()
        try:
            # another account waits for 2 (one free, the others held by this account): it holds the free one back
            ticket = Ticket(folder, request_of(2, None, Criteria(), "free-memory", 0.5))
            os.chown(ticket.name, 12345, -1, dir_fd=folder.fd)
            with ticket:
                with pytest.raises(GpuSelectionError, match=r"reserved for an older waiter in the queue \(#1: "):
                    claim_gpus(1)
            with claim_gpus(1) as claim:  # the waiter left: the GPU is free for anyone
                assert len(claim.gpus) == 1
        finally:
            folder.close()
    finally:
        os.write(gate_w, b"g")
        _reap([holder])


# -- real processes --------------------------------------------------------------------------------------

def _fork(fn: Callable[[], None]) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            _nvml.shutdown()
            fn()
        except BaseException:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    return pid


class Events:
    """Lines the children write into one pipe (each write is atomic: shorter than PIPE_BUF)."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        self.buffer = b""

    def say(self, line: str) -> None:
        os.write(self.write_fd, (line + "\n").encode())

    def next(self, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buffer:
            ready, _, _ = select.select([self.read_fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"no event within {timeout_s} s")
            self.buffer += os.read(self.read_fd, 65536)
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()


def _job(events: Events, name: str, count: int, gate_fd: int, poll_s: float,
         user: User | None = None) -> Callable[[], None]:
    """A job (of ``user``, else of this account): wait in the queue for ``count`` GPUs, say so, hold
    them until its gate says go."""

    def run() -> None:
        if user is not None:
            os.setgroups([])
            os.setgid(user.gid)
            os.setuid(user.uid)
        claim = claim_gpus(count, wait=True, timeout_s=120, poll_interval_s=poll_s)
        events.say(f"start {name} {' '.join(g.uuid or '' for g in claim.gpus)}")
        os.read(gate_fd, 1)
        events.say(f"end {name}")  # said before the release: nobody can start on its GPUs earlier
        claim.release()

    return run


def _live_tickets() -> list[QueuedTicket]:
    with open_claim_folder(create=False) as folder:
        return read_queue(folder, 4)[0]


def _wait_for_queue(length: int, timeout_s: float = 60.0) -> list[QueuedTicket]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        live = _live_tickets()
        if len(live) == length:
            return live
        time.sleep(0.01)
    raise AssertionError(f"the queue never held {length} tickets (it holds {len(_live_tickets())})")


def _reap(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def test_a_job_wanting_4_gpus_is_not_starved_by_a_stream_of_1_gpu_jobs(monkeypatch) -> None:
    """4 one-GPU jobs of another user run; a 4-GPU job starts waiting; more 1-GPU jobs keep
    arriving. As each running job ends, its GPU is held for the 4-GPU job, which starts when the
    last of the jobs that ran when it arrived has ended (within one job length) -- before any job
    that came after it. (The early jobs are another account's: a ticket waiting for GPUs its own
    account holds reserves nothing, issue 41.)"""
    users = unprivileged_users()
    if isinstance(users, str):
        pytest.skip(users)
    area = shared_area()
    spec = area / "spec.json"
    spec.write_text(json.dumps(FOUR))
    os.chmod(spec, 0o644)
    monkeypatch.setenv("GPUKIT_FAKE_GPUS", str(spec))
    monkeypatch.setenv("GPUKIT_CLAIM_DIR", str(area / "claims"))
    _nvml.shutdown()
    setup_folder(area / "claims")
    other = users[0]
    monkey_stall = queue.STALL_MIN_S
    queue.STALL_MIN_S = 120.0  # a busy 2-core machine must not make a slow head look stalled
    events, pids, gates = Events(), [], {}
    try:
        names: dict[int, str] = {}

        def launch(name: str, count: int, user: User | None = None) -> None:
            gate_r, gate_w = os.pipe()
            gates[name] = gate_w
            pids.append(_fork(_job(events, name, count, gate_r, 0.05, user)))
            names[pids[-1]] = name

        for i in range(4):
            launch(f"early{i}", 1, other)
        started = {events.next().split()[1] for _ in range(4)}
        assert started == {f"early{i}" for i in range(4)}
        launch("big", 4)
        _wait_for_queue(1)
        stream = [f"late{i}" for i in range(6)]
        for name in stream:  # they arrive after the big job
            launch(name, 1)
        queued = [names[t.pid] for t in _wait_for_queue(1 + len(stream))]
        assert queued[0] == "big" and sorted(queued[1:]) == stream  # the order they arrived in
        for i in range(4):  # the early jobs end one by one; no late job may start meanwhile
            os.write(gates[f"early{i}"], b"g")
            assert events.next() == f"end early{i}"
        started_big = events.next()  # the next start must be the big job's, on all 4 GPUs
        assert started_big.startswith("start big ") and len(started_big.split()) == 6, started_big
        os.write(gates["big"], b"g")
        assert events.next() == "end big"
        late_started = {events.next().split()[1] for _ in range(4)}
        assert late_started == set(queued[1:5])  # first come, first served among the late ones too
        for name in stream:
            os.write(gates[name], b"g")
    finally:
        queue.STALL_MIN_S = monkey_stall
        _reap(pids)
        shutil.rmtree(area, ignore_errors=True)


def test_40_waiters_with_random_sigkills_no_overlap_none_lost_fifo_kept(use_spec) -> None:
    """40 processes wait for 1 GPU each on a 4-GPU box while the test frees GPUs one at a time --
    by releasing a holder or SIGKILLing it -- and SIGKILLs random waiters. Each freed GPU must go
    to the oldest waiter still alive, never to a GPU someone holds, and every waiter not killed
    must get a GPU."""
    use_spec(FOUR)
    saved_stall = queue.STALL_MIN_S
    queue.STALL_MIN_S = 300.0
    rng = random.Random(26)
    events = Events()
    gates: dict[str, int] = {}
    pids: dict[str, int] = {}
    try:
        def launch(name: str) -> None:
            gate_r, gate_w = os.pipe()
            gates[name] = gate_w
            pids[name] = _fork(_job(events, name, 1, gate_r, 0.05))

        for i in range(4):
            launch(f"h{i}")
        holders = {}  # name -> uuid
        for _ in range(4):
            _, name, uuid = events.next().split()
            holders[name] = uuid
        for i in range(40):
            launch(f"w{i:02d}")
        tickets = _wait_for_queue(40)
        by_pid = {pid: name for name, pid in pids.items()}
        waiting = [by_pid[t.pid] for t in tickets]  # the queue's order: first come, first served
        assert sorted(waiting) == sorted(f"w{i:02d}" for i in range(40))
        killed_waiters, served = [], []
        while waiting:
            if rng.random() < 0.3 and len(waiting) > 1:  # a waiter dies: it leaves the queue at once
                victim = rng.choice(waiting)
                os.kill(pids[victim], signal.SIGKILL)
                os.waitpid(pids[victim], 0)
                waiting.remove(victim)
                killed_waiters.append(victim)
                continue
            leaving = rng.choice(sorted(holders))
            if rng.random() < 0.3:  # a holder is SIGKILLed: the kernel frees its GPU
                os.kill(pids[leaving], signal.SIGKILL)
                os.waitpid(pids[leaving], 0)
            else:
                os.write(gates[leaving], b"g")
                assert events.next() == f"end {leaving}"
            freed = holders.pop(leaving)
            kind, name, uuid = events.next().split()
            assert (kind, name) == ("start", waiting[0]), f"FIFO broken: {name} started, {waiting[0]} was first"
            assert uuid == freed and uuid not in holders.values(), "a GPU someone holds was given out"
            waiting.pop(0)
            holders[name] = uuid
            served.append(name)
        assert len(served) + len(killed_waiters) == 40 and len(killed_waiters) >= 5  # none lost
        for name in holders:
            os.write(gates[name], b"g")
        for name in holders:
            assert events.next().startswith("end ")
        assert _live_tickets() == []
    finally:
        queue.STALL_MIN_S = saved_stall
        _reap(list(pids.values()))
