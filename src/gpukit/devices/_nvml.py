"""The one module that talks to NVML.

Everything else in gpukit reads GPUs through :func:`query`. The backend is the real ``pynvml``
module (nvidia-ml-py), or a :class:`~gpukit.devices.FakeNvml` installed in-process or named by
``GPUKIT_FAKE_GPUS``. It is initialised lazily under a lock on first use and shut down at exit.
A machine without the NVIDIA driver is normal: :func:`backend` returns ``None`` and the reason is
reported once per process (logger ``gpukit.devices``).
"""

from __future__ import annotations

import atexit
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

from gpukit._util.envvars import FAKE_GPUS_ENV
from gpukit.devices._override import backend_override, set_backend_override

__all__ = [
    "FAKE_ENV",
    "query",
    "backend",
    "is_fake_backend",
    "driver_version",
    "unavailable_reason",
    "process_details",
    "set_backend_override",
    "silence_notice",
    "NvmlError",
    "GPU_GONE_CODES",
    "MEMORY_INFO_V2",
]

FAKE_ENV = FAKE_GPUS_ENV


def logger() -> Any:
    """The ``gpukit.devices`` logger, its notices' one channel; :mod:`logging` is imported only when
    one is given (it costs ``gpukit ls`` a share of its start)."""
    import logging

    return logging.getLogger("gpukit.devices")

try:  # nvidia-ml-py is a dependency, but a broken install must not break a CPU-only user
    import pynvml as _pynvml

    NvmlError: type[Exception] = _pynvml.NVMLError
    # Errors that mean the GPU itself is gone or unusable, not just that one field is missing.
    GPU_GONE_CODES = frozenset({
        _pynvml.NVML_ERROR_GPU_IS_LOST,
        _pynvml.NVML_ERROR_RESET_REQUIRED,
        _pynvml.NVML_ERROR_UNINITIALIZED,
        _pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
        _pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    })
    _FUNCTION_NOT_FOUND: int | None = _pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    # nvidia-ml-py maps an unversioned name (nvmlDeviceGetComputeRunningProcesses) to the newest
    # versioned symbol (_v3); a driver without that symbol makes it raise this, which is *not* an
    # NVMLError subclass.
    _LIBRARY_MISMATCH: tuple[type[Exception], ...] = tuple(
        cls for cls in (getattr(_pynvml, "NVMLLibraryMismatchError", None),) if cls is not None
    )
    #: ``version`` argument of ``nvmlDeviceGetMemoryInfo`` for the v2 struct (``None`` if unknown)
    MEMORY_INFO_V2: int | None = getattr(_pynvml, "nvmlMemory_v2", None)
except ImportError:  # pragma: no cover - exercised only without nvidia-ml-py
    _pynvml = None

    class NvmlError(Exception):  # type: ignore[no-redef]
        value = -1

    GPU_GONE_CODES = frozenset()
    _FUNCTION_NOT_FOUND = None
    _LIBRARY_MISMATCH = ()
    MEMORY_INFO_V2 = None


@dataclass
class _State:
    key: Hashable
    backend: Any | None  # pynvml module or FakeNvml; None when unavailable
    reason: str | None  # why NVML is unavailable
    driver_version: str | None


_lock = threading.RLock()
_state: _State | None = None
_notice_given = False
_atexit_registered = False


def silence_notice() -> None:
    """Mark the no-driver notice as given, for callers (the CLI) that say it in their own words."""
    global _notice_given
    _notice_given = True


def _wanted_key() -> Hashable:
    # Cheap to compute on every call, so tests and `ls --watch` see a changed env or spec file.
    override = backend_override()
    if override is not None:
        return ("override", override)  # the fake itself: _open uses the one the key was made for
    path = os.environ.get(FAKE_ENV)
    if path:
        try:
            mtime = os.stat(path).st_mtime_ns
        except OSError:
            mtime = None
        return ("fake", path, mtime)
    return ("real",)


def _open(key: Hashable) -> _State:
    nvml: Any
    if key[0] == "override":  # type: ignore[index]
        nvml = key[1]  # type: ignore[index]
    elif key[0] == "fake":  # type: ignore[index]
        from gpukit.devices._fake import FakeNvml  # imported when asked for (it needs pynvml's types)

        nvml = FakeNvml.from_file(key[1])  # type: ignore[index]  # FakeSpecError propagates: a typo must not pass silently
    elif _pynvml is None:
        return _State(key, None, "nvidia-ml-py (module pynvml) is not installed", None)
    else:
        nvml = _pynvml
    try:
        nvml.nvmlInit()
    except NvmlError as exc:
        code = getattr(exc, "value", None)
        if _pynvml is not None and code in (_pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, _pynvml.NVML_ERROR_DRIVER_NOT_LOADED):
            reason = f"no NVIDIA GPU/driver found ({exc})"
        else:
            reason = f"no NVIDIA GPU/driver found: NVML failed to initialise ({exc})"
        return _State(key, None, reason, None)
    _register_atexit()
    try:
        version = nvml.nvmlSystemGetDriverVersion()
        version = version.decode() if isinstance(version, bytes) else str(version)
    except NvmlError:
        version = None
    return _State(key, nvml, None, version)


def _close(state: _State) -> None:
    if state.backend is not None:
        try:
            state.backend.nvmlShutdown()
        except NvmlError:  # already shut down, or the driver went away: nothing left to release
            pass


def _register_atexit() -> None:
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(shutdown)
        _atexit_registered = True


def shutdown() -> None:
    """Shut NVML down (registered with atexit). The next query initialises it again."""
    global _state
    with _lock:
        if _state is not None:
            _close(_state)
            _state = None


def _current() -> _State:
    global _state, _notice_given
    key = _wanted_key()
    state = _state
    if state is not None and state.key == key:
        return state
    with _lock:
        if _state is None or _state.key != key:
            if _state is not None:
                _close(_state)
                _state = None
            _state = _open(key)
            if _state.reason is not None and not _notice_given:
                _notice_given = True
                logger().warning("gpukit: %s; GPU features are off and work falls back to the CPU.", _state.reason)
        return _state


def backend() -> Any | None:
    """The initialised NVML backend, or ``None`` when there is no NVIDIA driver (reported once)."""
    return _current().backend


def is_fake_backend() -> bool:
    """Whether NVML answers from a :class:`~gpukit.devices.FakeNvml` (in-process or ``GPUKIT_FAKE_GPUS``)."""
    state = _current()
    return state.backend is not None and state.key[0] != "real"  # type: ignore[index]


def unavailable_reason() -> str | None:
    """Why NVML is unavailable (e.g. ``"no NVIDIA GPU/driver found (...)"``), or ``None`` when it works."""
    return _current().reason


def driver_version() -> str | None:
    """The NVIDIA driver version, or ``None`` without a driver."""
    return _current().driver_version


def query(name: str, *args: Any, optional: bool = False, fallbacks: Sequence[str] = ()) -> Any:
    """Call NVML function ``name`` (e.g. ``"nvmlDeviceGetMemoryInfo"``) with ``args``.

    Args:
        name: a ``pynvml`` function name.
        optional: the value may legitimately be missing: return ``None`` on "Not Supported",
            "No Permission" and similar per-field failures, and when neither the bindings nor the
            driver have the function. Errors that mean the GPU is gone (``GPU_GONE_CODES``) still
            raise.
        fallbacks: older names to call, in order, when the driver lacks ``name`` (e.g.
            ``"nvmlDeviceGetComputeRunningProcesses_v2"`` on drivers without the ``_v3`` symbol
            that nvidia-ml-py 12+ calls for the unversioned name).

    Raises:
        NvmlError: the real ``pynvml.NVMLError`` subclass, from the real or the fake backend (a
            function the driver lacks is ``NVMLError_FunctionNotFound``).
        RuntimeError: NVML is unavailable (callers check :func:`backend` first), or the installed
            bindings have none of the names.
    """
    nvml = backend()
    if nvml is None:
        raise RuntimeError(f"NVML is unavailable: {unavailable_reason()}")
    missing: BaseException | None = None
    for candidate in (name, *fallbacks):
        fn: Callable[..., Any] | None = getattr(nvml, candidate, None)
        if fn is None:
            continue
        try:
            return fn(*args)
        except _LIBRARY_MISMATCH as exc:  # the driver lacks the symbol the bindings chose
            missing = exc
        except NvmlError as exc:
            code = getattr(exc, "value", None)
            if code is not None and code == _FUNCTION_NOT_FOUND:
                missing = exc
                continue
            if optional and code not in GPU_GONE_CODES:
                return None
            raise
    if optional:
        return None
    if missing is None:
        raise RuntimeError(f"the installed nvidia-ml-py has no {name}(); upgrade it")
    if isinstance(missing, NvmlError):
        raise missing
    raise NvmlError(_FUNCTION_NOT_FOUND) from missing  # callers handle NVML errors only


def process_details(pid: int) -> tuple[str | None, str | None]:
    """``(user, command)`` of a GPU process; ``None`` for what this process cannot see.

    NVML reports host pids; inside a container (another pid namespace) or for another user's
    process without permission, user and command are unknown and stay ``None``.
    """
    nvml = backend()
    details = getattr(nvml, "gpukit_process_details", None)
    if details is not None:
        return details(pid)
    import psutil  # lazily: only needed when a real GPU has processes

    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            user: str | None
            try:
                user = proc.username()
            except (psutil.AccessDenied, KeyError):  # KeyError: uid without a passwd entry
                user = None
            try:
                command = " ".join(proc.cmdline()) or proc.name()
            except psutil.AccessDenied:
                command = proc.name()
        return user, command or None
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None, None
