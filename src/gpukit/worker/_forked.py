"""The entry point of a worker forked from a notebook kernel (see ``gpukit.launch._notebook``): the
kernel's signal handlers and thread count are not the worker's, then as a spawned function worker.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from gpukit.worker._entry import run_function

__all__ = ["run_forked_function"]


def _reset_inherited_signals() -> None:
    # the kernel's own handlers (ipykernel's SIGINT, anything a cell installed) are not the worker's
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def run_forked_function(fn: Callable[..., Any], *args: Any) -> Any:
    """Entry point of a forked function worker: the supervision of a spawned one, then ``fn(*args)``."""
    _reset_inherited_signals()
    threads = os.environ.get("OMP_NUM_THREADS")
    torch = sys.modules.get("torch")
    if threads and threads.isdigit() and torch is not None:
        torch.set_num_threads(int(threads))  # the kernel's torch read its thread count long before the fork
    return run_function(fn, *args)
