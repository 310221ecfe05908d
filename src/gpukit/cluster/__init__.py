"""Where the job runs: a plain machine, torchrun / ``gpukit run``, SLURM, or Kubernetes.

:func:`environment` is the one detector; everything that needs ranks, nodes, the master
address or the scheduler's GPUs asks it (the Session's strategies, ``gpukit run``,
``gpukit doctor``). SLURM's host-list grammar is parsed by :func:`parse_nodelist`;
:func:`requeue_job` puts a preempted job back in the queue.
Never imports torch.
"""

from __future__ import annotations

from gpukit.cluster._detect import KINDS, ClusterEnvironment, announce, environment
from gpukit.cluster._nodelist import MAX_HOSTS, parse_nodelist
from gpukit.cluster._requeue import (
    DEFAULT_MAX_REQUEUES,
    MAX_REQUEUES_ENV,
    RequeueOutcome,
    check_max_requeues,
    requeue_job,
)
from gpukit.cluster._slurm import (
    PORT_BASE,
    PORT_SPAN,
    agent_tasks_problem,
    gpu_mismatch,
    shared_gpu_problem,
    in_slurm_job,
    slurm_port,
)
from gpukit.cluster._vars import check_host, check_port, env_host, env_int, env_port, resolve_host, route_addr

__all__ = [
    "environment",
    "ClusterEnvironment",
    "KINDS",
    "announce",
    "parse_nodelist",
    "MAX_HOSTS",
    "slurm_port",
    "PORT_BASE",
    "PORT_SPAN",
    "gpu_mismatch",
    "shared_gpu_problem",
    "agent_tasks_problem",
    "in_slurm_job",
    "requeue_job",
    "RequeueOutcome",
    "check_max_requeues",
    "DEFAULT_MAX_REQUEUES",
    "MAX_REQUEUES_ENV",
    # checked values of the scheduler's variables, and host names
    "check_host",
    "check_port",
    "env_host",
    "env_int",
    "env_port",
    "resolve_host",
    "route_addr",
]
