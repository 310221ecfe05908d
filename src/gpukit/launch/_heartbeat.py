"""Hang detection: which rank stopped, where, while the others wait for it in a collective.

Worker side (:func:`start_heartbeat`, started by a Session under ``gpukit run``): a daemon
thread writes ``hb-rank{R}.json`` into the run's directory (``GPUKIT_RUN_DIR``) twice a second:
its pid, the time, whether the main thread is inside a collective (a frame of
``torch.distributed`` or of autograd's engine, where DDP waits for its all-reduce) and since
when, and the main thread's innermost frame. ``faulthandler`` is registered on SIGQUIT to dump
every thread's stack to ``stack-rank{R}.txt`` -- it works even while the process holds the GIL
(a stuck C call), when the heartbeat thread cannot run. SIGQUIT, not SIGUSR1/2: those are
the schedulers' preemption warnings.

Launcher side (:class:`StallMonitor`, a thread of ``gpukit run``): when some ranks have waited
in a collective for ``stall_s`` and others are not in one (or their heartbeat stopped), the
latter stalled: it asks each for its stack (SIGQUIT), prints the rank, where it is and the
stack, and remembers it so the failure summary blames the stalled rank, not the ranks whose
collective timed out waiting for it (``gpukit run --timeout``, ``GPUKIT_TIMEOUT_S``).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["start_heartbeat", "StallMonitor", "Stall", "stall_threshold_s", "HEARTBEAT_INTERVAL_S"]

HEARTBEAT_INTERVAL_S = 0.5
_STALL_MAX_S = 60.0
_WAIT_MARKERS = (f"torch{os.sep}distributed{os.sep}", f"torch{os.sep}autograd{os.sep}")
_started = False


def stall_threshold_s(timeout_s: float) -> float:
    """Waiting this long in a collective makes the launcher look for the stalled rank:
    half the collective timeout, at most 60 s (the timeout then ends the run)."""
    return min(_STALL_MAX_S, timeout_s / 2)


def _where(frame: Any) -> tuple[bool, str]:
    waiting, inner = False, ""
    while frame is not None:
        name = frame.f_code.co_filename
        if any(marker in name for marker in _WAIT_MARKERS):
            waiting = True
        elif not inner and f"{os.sep}gpukit{os.sep}" not in name:
            inner = f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return waiting, inner


def _beat(path: Path, rank: int, main_id: int) -> None:
    waiting_since: float | None = None
    tmp = path.with_name(f".{path.name}.tmp")
    while True:
        frame = sys._current_frames().get(main_id)
        waiting, where = _where(frame)
        now = time.time()
        waiting_since = (waiting_since or now) if waiting else None
        record = {"rank": rank, "pid": os.getpid(), "time": now, "waiting_since": waiting_since, "where": where}
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, path)
        except OSError:  # the launcher's directory is gone: nobody is watching
            return
        del frame
        time.sleep(HEARTBEAT_INTERVAL_S)


def start_heartbeat(rank: int, world_size: int) -> bool:
    """Start this worker's heartbeat and SIGQUIT stack dumps (under ``gpukit run``, >1 rank).

    Returns:
        ``True`` when started (or already running); ``False`` outside ``gpukit run``.
    """
    global _started
    from gpukit.launch._preemption import RUN_DIR_ENV

    directory = os.environ.get(RUN_DIR_ENV)
    if _started or not directory or world_size < 2 or threading.current_thread() is not threading.main_thread():
        return _started
    run_dir = Path(directory)
    try:
        stacks = open(run_dir / f"stack-rank{rank}.txt", "w")  # noqa: SIM115 - kept open for faulthandler
    except OSError:
        return False
    faulthandler.register(signal.SIGQUIT, file=stacks, all_threads=True, chain=False)
    threading.Thread(target=_beat, args=(run_dir / f"hb-rank{rank}.json", rank, threading.main_thread().ident),
                     name="gpukit-heartbeat", daemon=True).start()
    _started = True
    return True


@dataclass(frozen=True)
class Stall:
    """A rank that stopped while others waited for it."""

    rank: int
    pid: int
    where: str
    waited_s: float
    waiting_ranks: tuple[int, ...]
    stack: str

    def message(self) -> str:
        where = f" at {self.where}" if self.where else ""
        others = ", ".join(map(str, self.waiting_ranks))
        return (f"rank {self.rank} stalled{where}: it has not joined the collective that rank(s) {others} "
                f"have waited in for {self.waited_s:.0f} s")


class StallMonitor:
    """Reads the workers' heartbeats in ``run_dir``; reports a stalled rank once (see module doc).

    Args:
        run_dir: The run's ``GPUKIT_RUN_DIR``.
        stall_s: How long others must have waited in a collective.
        echo: Where the report goes (the launcher's stderr).
    """

    def __init__(self, run_dir: str | os.PathLike[str], stall_s: float, echo: Callable[[str], None]) -> None:
        self.run_dir = Path(run_dir)
        self.stall_s = stall_s
        self.echo = echo
        self.stalls: dict[int, Stall] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpukit-stall-monitor", daemon=True)

    def __enter__(self) -> StallMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _beats(self) -> dict[int, dict[str, Any]]:
        beats = {}
        for path in self.run_dir.glob("hb-rank*.json"):
            try:
                record = json.loads(path.read_text())
                beats[int(record["rank"])] = record
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return beats

    def check(self, now: float | None = None) -> list[Stall]:
        """One look at the heartbeats; returns (and reports) newly found stalled ranks."""
        now = time.time() if now is None else now
        beats = self._beats()
        waiting = {r: now - b["waiting_since"] for r, b in beats.items()
                   if b.get("waiting_since") and now - b["time"] < self.stall_s}
        long_waiters = {r: s for r, s in waiting.items() if s >= self.stall_s}
        if not long_waiters:
            return []
        for rank in [r for r in self.stalls if r in waiting]:
            del self.stalls[rank]  # it joined the collective after all: not the culprit
        suspects = [r for r in sorted(beats) if r not in waiting and r not in self.stalls]
        found = []
        for rank in suspects:
            beat = beats[rank]
            stall = Stall(rank=rank, pid=int(beat["pid"]), where=str(beat.get("where") or ""),
                          waited_s=max(long_waiters.values()), waiting_ranks=tuple(sorted(long_waiters)),
                          stack=self._stack(rank, int(beat["pid"])))
            self.stalls[rank] = stall
            found.append(stall)
            self.echo(f"gpukit: {stall.message()}; its stack:\n{stall.stack.rstrip() or '  (not available)'}")
        return found

    def _stack(self, rank: int, pid: int) -> str:
        path = self.run_dir / f"stack-rank{rank}.txt"
        try:
            os.kill(pid, signal.SIGQUIT)  # faulthandler in the worker writes every thread's stack
        except OSError:
            return ""
        deadline = time.monotonic() + 3.0
        text, size = "", -1
        while time.monotonic() < deadline:  # done when the dump has stopped growing
            time.sleep(0.2)
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            if text and len(text) == size:
                break
            size = len(text)
        return text

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - monitoring must never break the run
                continue
