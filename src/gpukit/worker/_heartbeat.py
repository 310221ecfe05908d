"""A worker's heartbeat: how its launcher finds which rank stopped, and where, while the others
wait for it in a collective.

:func:`start_heartbeat` (started by a Session under ``gpukit run``) starts a daemon
thread that writes ``hb-rank{R}.json`` into the run's directory (``GPUKIT_RUN_DIR``) twice a second:
its pid, the time, whether the main thread is inside a collective (a frame of
``torch.distributed`` or of autograd's engine, where DDP waits for its all-reduce) and since
when, and the main thread's innermost frame. ``faulthandler`` is registered on SIGQUIT to dump
every thread's stack to ``stack-rank{R}.txt`` -- it works even while the process holds the GIL
(a stuck C call), when the heartbeat thread cannot run. SIGQUIT, not SIGUSR1/2: those are
the schedulers' preemption warnings.

The launcher's side reads them: ``gpukit.launch._stall``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gpukit.worker._env import worker_env
from gpukit.worker._run_dir import heartbeat_path, stack_path

__all__ = ["start_heartbeat", "HEARTBEAT_INTERVAL_S"]

HEARTBEAT_INTERVAL_S = 0.5
_WAIT_MARKERS = (f"torch{os.sep}distributed{os.sep}", f"torch{os.sep}autograd{os.sep}")
_started = False


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
    directory = worker_env().run_dir
    if _started or not directory or world_size < 2 or threading.current_thread() is not threading.main_thread():
        return _started
    try:
        stacks = open(stack_path(directory, rank), "w")  # noqa: SIM115 - kept open for faulthandler
    except OSError:
        return False
    faulthandler.register(signal.SIGQUIT, file=stacks, all_threads=True, chain=False)
    threading.Thread(target=_beat, args=(heartbeat_path(directory, rank), rank, threading.main_thread().ident),
                     name="gpukit-heartbeat", daemon=True).start()
    _started = True
    return True
