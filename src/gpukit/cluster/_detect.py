"""The one detector of where this process runs: a plain machine, a launcher (torchrun or
``gpukit run``), a SLURM job, or a Kubernetes PyTorchJob pod.

Order of precedence, most specific first:

1. ``torchrun`` -- ``RANK``/``WORLD_SIZE`` with ``TORCHELASTIC_RUN_ID``: torchrun,
   ``gpukit run`` or ``session.launch`` started this process; this wins even inside a SLURM
   job (the workers of ``srun gpukit run``).
2. ``slurm`` -- an ``srun`` task (``SLURM_STEP_ID`` and ``SLURM_PROCID``): ranks from
   ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``/``SLURM_NODEID``.
3. ``torchrun`` -- ``RANK``/``WORLD_SIZE`` with ``LOCAL_RANK`` from another launcher.
4. ``slurm`` -- the batch script (or an ``salloc`` shell): one process, on the first node.
5. ``kubernetes`` -- ``KUBERNETES_SERVICE_HOST`` with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``
   (PyTorchJob: one pod per node).
6. ``torchrun`` -- ``RANK`` and ``WORLD_SIZE`` set by hand (the torchrun convention).
7. ``local`` -- none of these: one process on this machine.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from gpukit._util.envvars import PREEMPT_SIGNAL_ENV
from gpukit.cluster._slurm import in_slurm_job, in_slurm_step, read_slurm, slurm_gpus
from gpukit.cluster._vars import env_host, env_int, env_port
from gpukit.errors import ConfigurationError, DistributedError

__all__ = ["ClusterEnvironment", "environment", "announce", "KINDS"]

Kind = Literal["local", "torchrun", "slurm", "kubernetes"]
KINDS: tuple[str, ...] = ("local", "torchrun", "slurm", "kubernetes")


@dataclass(frozen=True)
class ClusterEnvironment:
    """Where this process runs, as :func:`environment` found it.

    Task-level fields (``rank``, ``world_size``, ``local_rank``, ``local_world_size``) describe
    this process as one rank of the job; node-level fields (``nodes``, ``node_rank``,
    ``hosts``) are what ``gpukit run`` uses when it is the node's agent.

    Attributes:
        kind: ``"local"``, ``"torchrun"``, ``"slurm"`` or ``"kubernetes"``.
        nodes: Machines (SLURM nodes, pods) taking part.
        node_rank: This machine's number among them (0 hosts the rendezvous).
        world_size: Processes (ranks) in the job as launched.
        rank: This process's rank.
        local_rank: Its rank among the processes on this machine.
        local_world_size: Processes on this machine.
        master_addr: Address of rank 0's machine (``None`` when not needed).
        master_port: Rendezvous port (``None`` when not needed).
        job_id: The scheduler's job id (SLURM), or the launcher's run id.
        gpus: GPUs the scheduler gave on this node (``SLURM_STEP_GPUS``/``SLURM_JOB_GPUS``);
            ``None`` when it gave none or there is no scheduler.
        restart_count: Times the scheduler requeued the job (``SLURM_RESTART_COUNT``).
        hosts: The job's host names, in order (SLURM), else empty.
        in_step: Under SLURM, whether this is an ``srun`` task (``False``: the batch script).
        variables: The environment variables the detection read, for reports (read-only).
    """

    kind: Kind = "local"
    nodes: int = 1
    node_rank: int = 0
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    job_id: str | None = None
    gpus: tuple[str, ...] | None = None
    restart_count: int = 0
    hosts: tuple[str, ...] = ()
    in_step: bool = False
    variables: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    @property
    def distributed(self) -> bool:
        """Whether a launcher or scheduler started this process as one rank of a job
        (``False`` on a plain machine and in a SLURM batch script outside ``srun``)."""
        return self.kind != "local" and (self.kind != "slurm" or self.in_step)

    def torch_variables(self) -> dict[str, str]:
        """``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
        ``MASTER_PORT`` for ``init_process_group(init_method="env://")`` (empty when local)."""
        if not self.distributed:
            return {}
        out = {
            "RANK": str(self.rank), "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size), "LOCAL_WORLD_SIZE": str(self.local_world_size),
        }
        if self.master_addr:
            out["MASTER_ADDR"] = self.master_addr
        if self.master_port is not None:
            out["MASTER_PORT"] = str(self.master_port)
        return out

    def describe(self) -> str:
        """One line saying what was detected, e.g. for ``gpukit doctor``."""
        if self.kind == "local":
            return "plain machine: one process, no launcher or scheduler"
        where = f"{self.master_addr}:{self.master_port}" if self.master_addr else "no master address"
        head = {
            "torchrun": "launched by torchrun / gpukit run",
            "kubernetes": "Kubernetes PyTorchJob pod",
            "slurm": f"SLURM job {self.job_id}" + ("" if self.in_step else " (batch script, not an srun task)"),
        }[self.kind]
        parts = [
            head,
            f"rank {self.rank} of {self.world_size} (local {self.local_rank} of {self.local_world_size})",
            f"node {self.node_rank} of {self.nodes}",
            f"master {where}",
        ]
        if self.gpus is not None:
            parts.append(f"scheduler GPUs {','.join(self.gpus)}")
        if self.restart_count:
            parts.append(f"requeued {self.restart_count}x")
        return "; ".join(parts)


def _launcher(env: Mapping[str, str], kind: Kind) -> dict[str, object]:
    """Fields from the torchrun variables (also PyTorchJob's, which follow the same names)."""
    hint = ("RANK and WORLD_SIZE must both be set to integers (LOCAL_RANK, MASTER_ADDR, MASTER_PORT too for "
            "several processes). Start the script with torchrun or `gpukit run`, or unset them.")
    try:
        world_size = env_int(env, "WORLD_SIZE", low=1, hint=hint)
        rank = env_int(env, "RANK", hint=hint)
        local_rank = env_int(env, "LOCAL_RANK", default=0 if kind == "kubernetes" else rank, hint=hint)
        local_world_size = env_int(env, "LOCAL_WORLD_SIZE", default=1 if kind == "kubernetes" else world_size,
                                   low=1, hint=hint)
        master_port = env_port(env, "MASTER_PORT")
        master_addr = env_host(env, "MASTER_ADDR")
        if kind == "kubernetes":  # a pod is a node; PET_* are what the operator gives torchrun
            nodes = env_int(env, "PET_NNODES", default=world_size, low=1, hint=hint)
            node_rank = env_int(env, "PET_NODE_RANK", default=rank, hint=hint)
        else:
            nodes = env_int(env, "GROUP_WORLD_SIZE", default=max(1, world_size // local_world_size), low=1, hint=hint)
            node_rank = env_int(env, "GROUP_RANK", default=0, hint=hint)
    except ConfigurationError as exc:
        raise DistributedError(f"Invalid launch environment: {exc}") from None
    if not 0 <= rank < world_size:
        raise DistributedError(f"RANK={rank} is outside 0..WORLD_SIZE-1 ({world_size}).")
    return dict(
        nodes=nodes, node_rank=node_rank, world_size=world_size, rank=rank, local_rank=local_rank,
        local_world_size=local_world_size, master_addr=master_addr, master_port=master_port,
    )


def _scheduler(env: Mapping[str, str]) -> dict[str, object]:
    """What the scheduler says about the job, whoever launched this process."""
    if not in_slurm_job(env):
        return {"job_id": env.get("TORCHELASTIC_RUN_ID") or None}
    try:
        restarts = env_int(env, "SLURM_RESTART_COUNT", default=0)
    except ConfigurationError:
        restarts = 0
    return {
        "job_id": env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"),
        "gpus": slurm_gpus(env),
        "restart_count": restarts,
    }


_READ_PREFIXES = ("SLURM_", "PET_", "TORCHELASTIC_", "GROUP_")
_READ_NAMES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "KUBERNETES_SERVICE_HOST", "CUDA_VISIBLE_DEVICES", PREEMPT_SIGNAL_ENV,
)


def environment(environ: Mapping[str, str] | None = None) -> ClusterEnvironment:
    """Detect where this process runs (see the module docstring for the order).

    Args:
        environ: The environment to read; default ``os.environ``.

    Returns:
        A frozen :class:`ClusterEnvironment`.

    Raises:
        DistributedError: a launcher's variables are set but incomplete or not integers.
        ConfigurationError: SLURM variables that contradict each other or cannot be read
            (a malformed node list).
    """
    env = os.environ if environ is None else environ
    has_rank = "WORLD_SIZE" in env or "RANK" in env
    kind: Kind
    if has_rank and "TORCHELASTIC_RUN_ID" in env:
        kind, fields = "torchrun", _launcher(env, "torchrun")
    elif in_slurm_step(env):
        # RANK etc. here are SLURM's own, exported by a Session (or by the job script)
        kind, fields = "slurm", read_slurm(env)
    elif has_rank and "LOCAL_RANK" in env:
        kind, fields = "torchrun", _launcher(env, "torchrun")
    elif in_slurm_job(env):
        kind, fields = "slurm", read_slurm(env)
    elif has_rank and env.get("KUBERNETES_SERVICE_HOST"):
        kind, fields = "kubernetes", _launcher(env, "kubernetes")
    elif has_rank:
        kind, fields = "torchrun", _launcher(env, "torchrun")
    else:
        kind, fields = "local", {}
    fields.update(_scheduler(env))
    variables = MappingProxyType({k: v for k, v in env.items() if k.startswith(_READ_PREFIXES) or k in _READ_NAMES})
    return ClusterEnvironment(kind=kind, variables=variables, **fields)  # type: ignore[arg-type]


_announced = False


def announce(env: ClusterEnvironment | None = None, *, force: bool = False, under_gpukit: bool = False) -> bool:
    """Print what was detected, once per process, on rank 0 (stderr), when it is a cluster.

    Nothing is printed on a plain machine, nor in workers of ``gpukit run`` (``under_gpukit``:
    a gpukit launcher started this process and already said it). Returns whether a line was printed.
    """
    global _announced
    env = env if env is not None else environment()
    if _announced and not force:
        return False
    quiet = env.kind == "local" or (env.kind == "torchrun" and under_gpukit)
    if quiet or env.rank != 0:
        return False
    _announced = True
    host = socket.gethostname()
    print(f"gpukit: {env.describe()} [on {host}]", file=sys.stderr, flush=True)
    return True
