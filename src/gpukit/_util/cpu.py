"""CPUs this process may use, how busy other work keeps them, and the DataLoader worker count gpukit
derives from them (no torch)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

__all__ = ["MAX_AUTO_WORKERS", "usable_cpu_count", "auto_worker_count", "threads_that_fit", "CpuShare",
           "CpuClock"]

MAX_AUTO_WORKERS = 8
#: other work keeping at least this many CPUs busy makes a shared machine (below: noise, daemons)
_SHARED_CPUS = 0.5


def usable_cpu_count() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def auto_worker_count(usable_cpus: int, local_world_size: int) -> int:
    """``usable CPUs // processes on this node - 1`` (a core left for each training loop), in 0..8."""
    per_process = usable_cpus // max(1, local_world_size)
    return max(0, min(MAX_AUTO_WORKERS, per_process - 1))


def threads_that_fit(usable_cpus: int, busy_cpus: float) -> int:
    """Compute threads that fit in the CPUs other work leaves free (at least 1): torch's default of one
    thread per core oversubscribes a machine others keep busy (a one-process CPU run measured ~12x slower
    than with one thread per free core)."""
    return max(1, int(usable_cpus - busy_cpus + 0.5))


@dataclass(frozen=True)
class CpuShare:
    """How much of this process's CPUs other work used over an interval.

    Attributes:
        usable_cpus: CPUs this process may run on.
        others_cpus: CPUs' worth of time other processes used on them (busy time / wall time).
        threads: This process's compute threads (``torch.get_num_threads()``), ``None`` if unknown.
    """

    usable_cpus: int
    others_cpus: float
    threads: int | None = None

    @property
    def shared(self) -> bool:
        """Whether other work kept a real part of the CPUs busy."""
        return self.others_cpus >= _SHARED_CPUS

    @property
    def fitting_threads(self) -> int:
        """Threads that fit in what other work leaves free."""
        return threads_that_fit(self.usable_cpus, self.others_cpus)

    @property
    def oversubscribed(self) -> bool:
        """Shared, and this process runs more compute threads than fit."""
        return self.shared and self.threads is not None and self.threads > self.fitting_threads

    def describe(self) -> str:
        """``other work used 1.6 of the 2 usable CPUs``."""
        return f"other work used {self.others_cpus:.1f} of the {self.usable_cpus} usable CPUs"

    def thread_fix(self) -> str:
        """``torch.set_num_threads(1) (or OMP_NUM_THREADS=1)``."""
        n = self.fitting_threads
        return f"torch.set_num_threads({n}) (or OMP_NUM_THREADS={n})"


class CpuClock:
    """Measures, between two readings, how busy other processes kept this process's CPUs (Linux:
    ``/proc/stat`` for the CPUs of its affinity mask, minus its own and its children's CPU time).
    Elsewhere, or where either cannot be read, :meth:`share_since` returns ``None``."""

    def __init__(self) -> None:
        self._last = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float] | None:
        """(wall s, busy s of the usable CPUs, this process's and its children's CPU s)."""
        try:
            cpus = {f"cpu{n}" for n in os.sched_getaffinity(0)}
            tick = os.sysconf("SC_CLK_TCK")
            busy = 0
            with open("/proc/stat", "rb") as file:
                for raw in file.read(1 << 20).splitlines():
                    fields = raw.decode("ascii", "replace").split()
                    if fields and fields[0] in cpus and len(fields) >= 8:
                        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
                        busy += user + nice + system + irq + softirq + steal
            import psutil

            me = psutil.Process()
            own = sum(me.cpu_times()[:4])  # user, system, children_user, children_system (reaped)
            for child in me.children(recursive=True):  # loader workers, alive
                try:
                    own += sum(child.cpu_times()[:2])
                except psutil.Error:
                    continue
            return time.monotonic(), busy / tick, own
        except (AttributeError, OSError, ValueError, ImportError):
            return None
        except Exception:  # noqa: BLE001 - psutil's errors: a measurement is never worth failing over
            return None

    def share_since(self, threads: int | None = None) -> CpuShare | None:
        """What other work used since the last reading (or since this clock was made); starts the next."""
        last, now = self._last, self._read()
        self._last = now
        if last is None or now is None or now[0] - last[0] < 0.05:
            return None
        wall_s = now[0] - last[0]
        others = max(0.0, (now[1] - last[1]) - (now[2] - last[2])) / wall_s
        return CpuShare(usable_cpu_count(), round(others, 1), threads)
