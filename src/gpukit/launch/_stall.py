"""The launcher's stall monitor: which rank stopped, where, while the others wait for it in a
collective.

Every worker of a ``gpukit run`` writes a heartbeat into the run's directory
(:mod:`gpukit.worker._heartbeat`). :class:`StallMonitor`, a thread of the launcher, reads them:
when some ranks have waited in a collective for ``stall_s`` and others are not in one (or their
heartbeat stopped), the latter stalled: it asks each for its stack (SIGQUIT), prints the rank,
where it is and the stack, and remembers it so the failure summary blames the stalled rank, not
the ranks whose collective timed out waiting for it (``gpukit run --timeout``, ``GPUKIT_TIMEOUT_S``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpukit.worker import read_heartbeats, stack_path

__all__ = ["StallMonitor", "Stall", "stall_threshold_s"]

_STALL_MAX_S = 60.0


def stall_threshold_s(timeout_s: float) -> float:
    """Waiting this long in a collective makes the launcher look for the stalled rank:
    half the collective timeout, at most 60 s (the timeout then ends the run)."""
    return min(_STALL_MAX_S, timeout_s / 2)


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

    def check(self, now: float | None = None) -> list[Stall]:
        """One look at the heartbeats; returns (and reports) newly found stalled ranks."""
        now = time.time() if now is None else now
        beats = read_heartbeats(self.run_dir)
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
        path = stack_path(self.run_dir, rank)
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
