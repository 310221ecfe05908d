"""LaunchSpec: every setting of a launch, checked once, where it is made.

``gpukit run`` builds one from its options, ``Session.launch`` and the demo from theirs, and
``launch_script`` / ``launch_function`` take it (or its fields as keywords); everything below them
reads the typed values. What the workers are told is derived from it (``gpukit.worker.WorkerEnv``).
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from gpukit._util.envvars import MAX_NPROC_ENV
from gpukit._util.timeouts import parse_timeout_s
from gpukit._util.units import whole_number
from gpukit.cluster import check_max_requeues
from gpukit.errors import ConfigurationError
from gpukit.launch._gpu_request import GpuRequest
from gpukit.launch._topology import Topology
from gpukit.worker import parse_preempt_signal

__all__ = ["LaunchSpec", "DEFAULT_GRACE_S", "ELASTIC_MAX_RESTARTS", "spec_from"]

DEFAULT_GRACE_S = 10.0
#: group restarts an elastic launch (``--nnodes MIN:MAX``) allows when ``--max-restarts`` is not given:
#: each node lost or joining is one (torch elastic re-forms the group by restarting it)
ELASTIC_MAX_RESTARTS = 10


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return value


def _check_nproc_cap(nproc: int) -> None:
    """Refuse a worker count no machine runs well (``--nproc 100000`` would fork until the OS gives out)."""
    cores = os.cpu_count() or 1
    given = os.environ.get(MAX_NPROC_ENV)
    cap = max(8, 4 * cores) if not given else whole_number(given)
    if cap is None or cap < 1:
        shown = given if given is None or len(given) <= 40 else given[:40] + "..."
        raise ConfigurationError(f"{MAX_NPROC_ENV}={shown!r}: give the most worker processes per node, a whole "
                                 "number >= 1 (or unset it for the default: 4 per CPU core, at least 8).")
    if nproc > cap:
        raise ConfigurationError(
            f"nproc (--nproc) {nproc} is more worker processes than this machine runs well: it has {cores} "
            f"CPU core(s) and the cap is {cap} (4 per core, at least 8). Use fewer, spread the job over "
            f"machines (--nnodes), or raise the cap with {MAX_NPROC_ENV}={nproc} if you mean it."
        )


@dataclass(frozen=True)
class LaunchSpec:
    """How to launch workers: ``gpukit run``'s options as one checked value.

    Attributes:
        nproc: Workers on this node; ``None``: the number of GPUs claimed, or 1 (scripts).
        cpu: Run on the CPU (gloo); GPUs are hidden from the workers.
        gpus: Which GPUs (given as a :class:`GpuRequest`, a count, ``"all"``, ``--gpus`` text or
            GPU indices/UUIDs; kept as a :class:`GpuRequest`). Claimed for the launch's duration.
        min_free_memory, max_utilization, wait, wait_timeout_s: GPU selection (see
            ``gpukit.devices.claim_gpus``); waiting is in the fair queue.
        share_gpus: Also take GPUs other users' processes are using (``--share``); by default
            such a GPU is busy.
        max_restarts: Restart the whole group this many times after a failure (with ``min_nodes``:
            after a failure or a change of nodes; 0 there means ``ELASTIC_MAX_RESTARTS``).
        min_nodes: Elastic (``--nnodes MIN:MAX``): the job goes on with as few as this many of
            ``topology.nnodes`` nodes -- when a node dies the others stop, re-form without it and
            restart their workers (which resume from the last complete checkpoint, at the new size),
            and a node that joins later makes the group restart at the larger size. ``None``: exactly
            ``topology.nnodes`` nodes, and a lost node ends the job.
        grace_s: Seconds between SIGTERM and SIGKILL when workers are stopped.
        topology: Nodes and rendezvous; ``None``: from SLURM/Kubernetes, else this machine only.
        timeout_s: The workers' collective timeout (``GPUKIT_TIMEOUT_S``; default: a Session's 1800).
            A rank that stops calling collectives is named (with its stack) after
            min(60, timeout_s / 2) s; the timeout ends the run.
        preempt_signal: The scheduler's preemption warning (``"USR2"``, ``"USR1"``, ``"TERM"`` or the
            signal; ``None``: ``GPUKIT_PREEMPT_SIGNAL``, else USR2): it stops the run like SIGTERM,
            and under SLURM node 0 then requeues the job (``scontrol requeue``). Scripts only.
        max_requeues: Requeue only while ``SLURM_RESTART_COUNT`` is below this (``None``:
            ``GPUKIT_MAX_REQUEUES``, else 10). Scripts only.
        record_dir: Every worker's Session records its run there (``GPUKIT_RECORD_DIR``).
        verbose: Keep torch elastic's own log lines.

    Raises:
        ConfigurationError: a setting out of range or contradicting another, naming it.
    """

    nproc: int | None = None
    cpu: bool = False
    gpus: GpuRequest = GpuRequest()
    min_free_memory: int | str | None = None
    max_utilization: float | None = None
    wait: bool = False
    wait_timeout_s: float | None = None
    share_gpus: bool = False
    max_restarts: int = 0
    min_nodes: int | None = None
    grace_s: float = DEFAULT_GRACE_S
    topology: Topology | None = None
    timeout_s: float | None = None
    preempt_signal: signal.Signals | None = None
    max_requeues: int | None = None
    record_dir: str | None = None
    verbose: bool = False

    def __post_init__(self) -> None:
        if self.nproc is not None:
            _check_int("nproc (--nproc)", self.nproc, 1)
            _check_nproc_cap(self.nproc)
        _check_int("max_restarts (--max-restarts)", self.max_restarts, 0)
        if self.min_nodes is not None:
            _check_int("min_nodes (--nnodes MIN:MAX)", self.min_nodes, 1)
            most = self.topology.nnodes if self.topology is not None else None
            if most is not None and self.min_nodes > most:
                raise ConfigurationError(
                    f"--nnodes {self.min_nodes}:{most}: the fewest nodes ({self.min_nodes}) is more than the most "
                    f"({most}); give MIN <= MAX, e.g. --nnodes 1:{most}.")
            if self.max_restarts == 0:  # re-forming after a lost node is a restart of the group
                object.__setattr__(self, "max_restarts", ELASTIC_MAX_RESTARTS)
        if not isinstance(self.share_gpus, bool):
            raise ConfigurationError(f"share_gpus (--share) must be True or False, got {self.share_gpus!r}.")
        grace_s = self.grace_s
        if not isinstance(grace_s, (int, float)) or isinstance(grace_s, bool) or not math.isfinite(grace_s) \
                or grace_s < 0:
            raise ConfigurationError(f"grace_s (--grace) must be a finite number of seconds >= 0, got {grace_s!r}.")
        # the forms a caller may give, each turned into its one typed value here
        gpus = GpuRequest.of(self.gpus)  # type: ignore[arg-type]
        if self.cpu and not gpus.automatic:
            raise ConfigurationError(f"--cpu and --gpus {gpus} contradict each other: give one of them.")
        object.__setattr__(self, "gpus", gpus)
        if self.timeout_s is not None:
            object.__setattr__(self, "timeout_s", parse_timeout_s(self.timeout_s, "timeout_s (--timeout)"))
        if self.preempt_signal is not None and not isinstance(self.preempt_signal, signal.Signals):
            object.__setattr__(self, "preempt_signal", parse_preempt_signal(self.preempt_signal))
        if self.max_requeues is not None:
            object.__setattr__(self, "max_requeues", check_max_requeues(self.max_requeues))
        if self.record_dir is not None:
            object.__setattr__(self, "record_dir", os.path.abspath(os.fspath(self.record_dir)))


_FIELDS = tuple(f.name for f in fields(LaunchSpec))


def spec_from(spec: LaunchSpec | None, settings: Mapping[str, Any], what: str) -> LaunchSpec:
    """``spec``, or one made of ``settings`` (a launch function's keywords) -- not both.

    Raises:
        ConfigurationError: both given, or a keyword that is not a LaunchSpec field.
    """
    if spec is not None and settings:
        raise ConfigurationError(f"{what}: give a LaunchSpec or its settings as keywords "
                                 f"({', '.join(sorted(settings))}), not both.")
    unknown = sorted(set(settings) - set(_FIELDS))
    if unknown:
        raise ConfigurationError(f"{what}: unknown setting(s) {', '.join(unknown)}; a launch takes "
                                 f"{', '.join(_FIELDS)}.")
    return spec if spec is not None else LaunchSpec(**settings)

