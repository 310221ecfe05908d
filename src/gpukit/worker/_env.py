"""The one contract between a launcher and its workers: :class:`WorkerEnv`.

``gpukit run`` and ``launch_function`` write it into every worker's environment
(:meth:`WorkerEnv.to_env`); inside the worker, gpukit reads it back as typed values
(:meth:`WorkerEnv.from_env`) -- nowhere else are these variables read or written. The last four
fields may also be set by hand for a process no gpukit launcher started (``srun python
train.py``). The variables' names are in :mod:`gpukit._util.envvars`; README.md documents them.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from gpukit._util.envvars import (
    CPU_ENV,
    GRACE_ENV,
    LAUNCHER_PID_ENV,
    MAX_REQUEUES_ENV,
    PREEMPT_SIGNAL_ENV,
    RECORD_DIR_ENV,
    RUN_DIR_ENV,
    RUN_ID_ENV,
    TIMEOUT_ENV,
)
from gpukit._util.timeouts import DEFAULT_TIMEOUT_S, parse_timeout_s
from gpukit.cluster import check_max_requeues
from gpukit.errors import ConfigurationError

__all__ = [
    "WorkerEnv", "collective_timeout_s", "parse_preempt_signal", "worker_env",
    "DEFAULT_PREEMPT_SIGNAL", "PREEMPT_SIGNAL_CHOICES",
]

#: SIGUSR2 by default: NCCL and some MPI stacks use SIGUSR1 themselves (submitit's choice too).
DEFAULT_PREEMPT_SIGNAL = "USR2"
PREEMPT_SIGNAL_CHOICES = ("USR2", "USR1", "TERM")


def parse_preempt_signal(text: str, source: str = "--signal") -> signal.Signals:
    """``"USR2"``/``"SIGUSR2"``/``"usr1"``/``"TERM"`` -> the signal.

    Raises:
        ConfigurationError: any other name.
    """
    name = str(text).strip().upper()
    name = name[3:] if name.startswith("SIG") else name
    if name not in PREEMPT_SIGNAL_CHOICES:
        raise ConfigurationError(
            f"{source} {text!r} is not a preemption signal gpukit handles; use one of "
            f"{', '.join(PREEMPT_SIGNAL_CHOICES)} (the signal named in `#SBATCH --signal=B:USR2@90`)."
        )
    return signal.Signals[f"SIG{name}"]


def _pid(value: str) -> int:
    if not (value.isascii() and value.isdigit()) or len(value) > 10:
        raise ConfigurationError(f"{LAUNCHER_PID_ENV}={value!r}: the launcher's process id, a whole number; "
                                 "gpukit run sets it for its workers -- unset it in a process gpukit did not start.")
    return int(value)


def _grace_s(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ConfigurationError(f"{GRACE_ENV}={value!r}: seconds from SIGTERM to SIGKILL, a finite number >= 0; "
                                 "gpukit run sets it for its workers (--grace).")
    return seconds


@dataclass(frozen=True)
class WorkerEnv:
    """What a launcher tells each worker, as typed values (``None``: not given).

    Attributes:
        run_id: The run's id (``GPUKIT_RUN_ID``): claims are labelled with it.
        launcher_pid: The launcher's pid (``GPUKIT_LAUNCHER_PID``): the worker dies with it; set
            only under a gpukit launcher.
        grace_s: Seconds from the launcher's SIGTERM to its SIGKILL (``GPUKIT_GRACE_S``).
        cpu: A ``--cpu`` run: gloo, GPUs hidden (``GPUKIT_CPU=1``).
        run_dir: The run's directory for stop markers and heartbeats (``GPUKIT_RUN_DIR``).
        timeout_s: The collective timeout (``GPUKIT_TIMEOUT_S``).
        preempt_signal: The scheduler's preemption warning (``GPUKIT_PREEMPT_SIGNAL``).
        max_requeues: The bound on requeues of a preempted SLURM job (``GPUKIT_MAX_REQUEUES``).
        record_dir: Where every Session records its run (``GPUKIT_RECORD_DIR``).
    """

    run_id: str | None = None
    launcher_pid: int | None = None
    grace_s: float | None = None
    cpu: bool = False
    run_dir: str | None = None
    timeout_s: float | None = None
    preempt_signal: signal.Signals | None = None
    max_requeues: int | None = None
    record_dir: str | None = None

    def to_env(self) -> dict[str, str]:
        """The variables to set in a worker's environment (the fields that are given)."""
        values = {
            RUN_ID_ENV: self.run_id,
            LAUNCHER_PID_ENV: None if self.launcher_pid is None else str(self.launcher_pid),
            GRACE_ENV: None if self.grace_s is None else f"{self.grace_s:g}",
            CPU_ENV: "1" if self.cpu else None,
            RUN_DIR_ENV: self.run_dir,
            TIMEOUT_ENV: None if self.timeout_s is None else repr(self.timeout_s),
            PREEMPT_SIGNAL_ENV: None if self.preempt_signal is None else self.preempt_signal.name[3:],
            MAX_REQUEUES_ENV: None if self.max_requeues is None else str(self.max_requeues),
            RECORD_DIR_ENV: self.record_dir,
        }
        return {name: value for name, value in values.items() if value is not None}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        """Read the contract from ``environ`` (default ``os.environ``); an empty variable is not given.

        Raises:
            ConfigurationError: a variable that does not parse, naming it and its value.
        """
        env = os.environ if environ is None else environ

        def given(name: str) -> str | None:
            return env.get(name) or None

        pid, grace, timeout = given(LAUNCHER_PID_ENV), given(GRACE_ENV), given(TIMEOUT_ENV)
        preempt, requeues = given(PREEMPT_SIGNAL_ENV), given(MAX_REQUEUES_ENV)
        return cls(
            run_id=given(RUN_ID_ENV),
            launcher_pid=None if pid is None else _pid(pid),
            grace_s=None if grace is None else _grace_s(grace),
            cpu=env.get(CPU_ENV) == "1",
            run_dir=given(RUN_DIR_ENV),
            timeout_s=None if timeout is None else parse_timeout_s(timeout, TIMEOUT_ENV),
            preempt_signal=None if preempt is None else parse_preempt_signal(preempt, PREEMPT_SIGNAL_ENV),
            max_requeues=None if requeues is None else check_max_requeues(requeues, MAX_REQUEUES_ENV),
            record_dir=given(RECORD_DIR_ENV),
        )


def collective_timeout_s(value: float | None = None) -> float:
    """The collective timeout to use: ``value``, else ``GPUKIT_TIMEOUT_S``, else 1800 s (all validated).

    Raises:
        ConfigurationError: ``value`` or the variable is not a positive finite number of seconds.
    """
    if value is not None:
        return parse_timeout_s(value)
    timeout_s = worker_env().timeout_s
    return DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s


#: every variable of the contract (what :meth:`WorkerEnv.from_env` reads)
_CONTRACT = (RUN_ID_ENV, LAUNCHER_PID_ENV, GRACE_ENV, CPU_ENV, RUN_DIR_ENV, TIMEOUT_ENV, PREEMPT_SIGNAL_ENV,
             MAX_REQUEUES_ENV, RECORD_DIR_ENV)
_read: tuple[tuple[str | None, ...], WorkerEnv] | None = None  # the variables' text, and what it parsed to


def worker_env() -> WorkerEnv:
    """What a launcher told this process (``os.environ``), the one place gpukit's own code reads it:
    parsed once, and again only when one of the variables changed (a test, a script that sets them).

    Raises:
        ConfigurationError: a variable that does not parse, naming it and its value (every call, until fixed).
    """
    global _read
    text = tuple(os.environ.get(name) for name in _CONTRACT)
    read = _read
    if read is None or read[0] != text:
        given = {name: value for name, value in zip(_CONTRACT, text) if value is not None}
        read = _read = (text, WorkerEnv.from_env(given))  # parsed from the very text it is kept under
    return read[1]
