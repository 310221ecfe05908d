"""``gpukit ls``: what the GPUs are doing, like nvidia-smi. Never imports torch."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any

import click

from gpukit.cli._common import FiniteFloatRange
from gpukit.devices import (
    FAKE_ENV, driver_version, list_gpus, selectable_units, silence_notice, unavailable_reason,
)

__all__ = ["ls"]


def _collect() -> dict[str, Any]:
    from gpukit.devices import ClaimState, read_claim_state

    gpus = list_gpus()
    state = read_claim_state(gpus) if gpus else ClaimState()
    return {"gpus": gpus, "claims": state.owners, "claim_state": state}


def _header(state: dict[str, Any]) -> str:
    fake = os.environ.get(FAKE_ENV)
    source = f"fake GPUs ({os.path.basename(fake)})" if fake else "NVML"
    n = len(state["gpus"])
    gpus = f"{n} GPU{'s' if n != 1 else ''}"
    return f"{gpus} · driver {driver_version() or 'n/a'} · {source} · {time.strftime('%H:%M:%S')}"


def _as_json(state: dict[str, Any]) -> str:
    claims = state["claim_state"]
    keys = ("pid", "user", "since", "run", "rank", "host", "blocked")
    return json.dumps({
        "driver_version": driver_version(),
        "notice": unavailable_reason(),
        "gpus": [g.to_dict() for g in state["gpus"]],
        "claims": [{"uuid": u, "pid": None if owner is None else owner.get("pid"),
                    **{k: owner[k] for k in keys[1:] if owner is not None and owner.get(k) is not None}}
                   for u, owner in state["claims"].items()],
        "queue": [{"position": i, "user": t.user, "gpus_wanted": t.count, "waiting_since": t.since,
                   "pid": t.pid, "run": t.run} for i, t in enumerate(claims.queue, 1)],
        "claim_folder": {"path": claims.folder, "shared": claims.shared, "notice": claims.notice,
                         "error": claims.error},
        "claim_problems": [{"what": p.what, "fix": p.fix, "severity": p.severity} for p in claims.problems],
        "selectable": [u.uuid for u in selectable_units(state["gpus"]) if u.usable],
    })


def _example_spec() -> str:
    """The shared-4gpu example spec, as a path that works from here (a checkout has it)."""
    spec = os.path.join("examples", "fake-gpus", "shared-4gpu.json")
    checkout = os.path.join(os.path.dirname(__file__), "..", "..", "..", spec)
    if not os.path.exists(spec) and os.path.exists(checkout):
        return os.path.abspath(checkout)
    return spec


def _no_gpu_message() -> str:
    reason = unavailable_reason() or "no NVIDIA GPU found"
    return (f"{reason[:1].upper()}{reason[1:]}.\n"
            "gpukit runs on the CPU here. To try the GPU features without GPUs:\n"
            f"  GPUKIT_FAKE_GPUS={_example_spec()} gpukit ls")


@click.command("ls", short_help="Show the GPUs and the processes on them, like nvidia-smi.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON (sizes in bytes).")
@click.option("--watch", type=FiniteFloatRange(min=0.1, max=86400), is_flag=False, flag_value=2.0, default=None,
              metavar="[SECONDS]", help="Refresh in place every SECONDS (default 2) until Ctrl-C.")
def ls(as_json: bool, watch: float | None) -> None:
    """Show the GPUs (memory, utilization, temperature, power, claims), the processes on them, and
    the queue of jobs waiting for GPUs.

    GPUs are numbered like nvidia-smi (PCI bus order). Set GPUKIT_FAKE_GPUS=spec.json to
    show fake GPUs from a spec (see examples/fake-gpus/).
    """
    silence_notice()  # this command says "no GPU" in its own words below
    try:
        if watch is None:
            _show_once(as_json)
        else:
            _watch(as_json, watch)
    except KeyboardInterrupt:  # Ctrl-C ends --watch; that is success, not an error
        pass
    except BrokenPipeError:  # `gpukit ls --watch | head -1`: the reader left; leave quietly
        _quiet_stdout()


def _show_once(as_json: bool) -> None:
    state = _collect()
    if as_json:
        click.echo(_as_json(state))
        return
    if not state["gpus"] and unavailable_reason():
        click.echo(_no_gpu_message())
        return
    from rich.console import Console

    from gpukit.cli._gpu_table import render_gpus

    console = Console()
    console.print(render_gpus(state["gpus"], state["claims"], _header(state), width=console.width,
                              claim_state=state["claim_state"]))


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush does not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _reader_left() -> None:
    raise BrokenPipeError


def _terminal_width() -> int:
    """The terminal's width now: follows resizes (and COLUMNS, when set)."""
    return shutil.get_terminal_size(fallback=(80, 24)).columns


_RESIZE_POLL_S = 0.05  # how soon a resize is noticed


def _watch(as_json: bool, interval_s: float) -> None:
    if as_json:  # one JSON document per line, for piping into other tools
        while True:
            click.echo(_as_json(_collect()))
            sys.stdout.flush()
            time.sleep(interval_s)
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    from gpukit.cli._gpu_table import GpuHistory, render_gpus

    console = Console()
    console.on_broken_pipe = _reader_left  # type: ignore[method-assign]  # rich would exit 1
    history = GpuHistory()
    # a terminal resize (SIGWINCH) redraws at once instead of at the next tick. The handler only
    # sets a flag: a threading.Event set from a handler can deadlock when the signal lands while
    # the main thread holds the Event's own lock inside wait().
    resized = [False]

    def on_resize(*_: Any) -> None:
        resized[0] = True

    if hasattr(signal, "SIGWINCH") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGWINCH, on_resize)

    def frame() -> Any:
        state = _collect()
        if not state["gpus"] and unavailable_reason():
            return Text(_no_gpu_message())
        history.add(state["gpus"])
        console.width = _terminal_width()  # rich fixes its width at start; follow the terminal
        stop = " · Ctrl-C to stop" if console.is_terminal else ""
        return render_gpus(state["gpus"], state["claims"], _header(state), width=console.width,
                           history=history, hint=stop, claim_state=state["claim_state"])

    def wait() -> None:
        deadline = time.monotonic() + interval_s
        while not resized[0] and time.monotonic() < deadline:
            time.sleep(min(_RESIZE_POLL_S, max(0.0, deadline - time.monotonic())))
        resized[0] = False

    if not console.is_terminal:  # piped or logged: one frame after another, not redrawn in place
        while True:
            console.print(frame())
            console.print()
            sys.stdout.flush()
            wait()
    with Live(frame(), console=console, auto_refresh=False, transient=False) as live:
        while True:
            wait()
            live.update(frame(), refresh=True)
