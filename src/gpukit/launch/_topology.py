"""Where the workers run (:class:`Topology`): this machine alone, or one node of several --
from the flags given and, on a cluster, from the scheduler -- and its checks.

Under ``srun gpukit run train.py`` (one task per node) or in a Kubernetes PyTorchJob pod,
``gpukit run`` is the node's agent: the number of nodes, this node's rank and the master
address and port come from :func:`gpukit.cluster.environment`, so no ``--nnodes``/
``--node-rank``/``--master-addr`` is needed. A flag that is given wins over the detected value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from gpukit.cluster import ClusterEnvironment, agent_tasks_problem, environment
from gpukit.errors import ConfigurationError

__all__ = ["Topology", "node_topology", "scheduler_gpu_count", "check_topology"]

_DEFAULT_PORT = 29500


@dataclass(frozen=True)
class Topology:
    """Where the workers run: one machine, or node ``node_rank`` of ``nnodes``.

    Attributes:
        nnodes: Machines taking part.
        node_rank: This machine's number; node 0 hosts the rendezvous.
        master_addr: Address of node 0 (required when ``nnodes > 1``).
        master_port: Port of the rendezvous on node 0.
        local_addr: This node's address as the other nodes reach it; by default the
            address of the interface that routes to ``master_addr``.
        rdzv_timeout_s: How long to wait for the master to answer and the nodes to join.
    """

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int = _DEFAULT_PORT
    local_addr: str | None = None
    rdzv_timeout_s: float = 300.0

    @property
    def single_machine(self) -> bool:
        """One node and no master address given: everything on localhost."""
        return self.nnodes == 1 and self.master_addr is None


def node_topology(
    *,
    nnodes: int | None = None,
    node_rank: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    local_addr: str | None = None,
    rdzv_timeout_s: float = 300.0,
    env: ClusterEnvironment | None = None,
) -> Topology:
    """This node's :class:`Topology`: the flags given, the rest from the scheduler.

    Args:
        nnodes, node_rank, master_addr, master_port: ``None`` where not given.
        local_addr, rdzv_timeout_s: As for :class:`Topology`.
        env: The detected environment (default: :func:`gpukit.cluster.environment`).

    Raises:
        ConfigurationError: ``srun`` started several copies of ``gpukit run`` on one node.
    """
    env = env if env is not None else environment()
    as_agent = (env.kind == "slurm" and env.in_step) or env.kind == "kubernetes"
    if env.kind == "slurm" and env.in_step:
        problem = agent_tasks_problem(env.local_world_size, env.hosts[env.node_rank] if env.hosts else None)
        if problem:
            raise ConfigurationError(problem)
    if as_agent and env.nodes > 1:
        nnodes = env.nodes if nnodes is None else nnodes
        node_rank = env.node_rank if node_rank is None else node_rank
        master_addr = master_addr or env.master_addr
        master_port = env.master_port if master_port is None else master_port
    return Topology(
        nnodes=1 if nnodes is None else nnodes,
        node_rank=0 if node_rank is None else node_rank,
        master_addr=master_addr,
        master_port=_DEFAULT_PORT if master_port is None else master_port,
        local_addr=local_addr,
        rdzv_timeout_s=rdzv_timeout_s,
    )


def scheduler_gpu_count(env: ClusterEnvironment | None = None, environ: Mapping[str, str] | None = None) -> int | None:
    """How many GPUs the scheduler gave this node (``None``: it gave none, or no scheduler).

    ``gpukit run`` under SLURM uses them all by default; selection never goes beyond them
    (it keeps to ``CUDA_VISIBLE_DEVICES``, which SLURM sets to the same GPUs).
    """
    env = env if env is not None else environment(environ)
    return len(env.gpus) if env.gpus else None


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"{name} must be an integer >= {minimum}, got {value!r}.")


def check_topology(topology: Topology) -> None:
    """Refuse a topology no rendezvous can complete, naming the flag to fix.

    Raises:
        ConfigurationError: a node rank out of range, several nodes without a master address,
            a port outside 1..65535 or a rendezvous timeout that is not a finite positive number.
    """
    _check_int("nnodes (--nnodes)", topology.nnodes, 1)
    _check_int("node_rank (--node-rank)", topology.node_rank, 0)
    if topology.node_rank >= topology.nnodes:
        raise ConfigurationError(
            f"--node-rank {topology.node_rank} is out of range for --nnodes {topology.nnodes}: "
            f"use 0..{topology.nnodes - 1}."
        )
    if topology.nnodes > 1 and not topology.master_addr:
        raise ConfigurationError(
            f"--nnodes {topology.nnodes} needs --master-addr: the address of node 0, the same on every node."
        )
    if not 1 <= topology.master_port <= 65535:
        raise ConfigurationError(f"--master-port must be in 1..65535, got {topology.master_port}.")
    if not 0 < topology.rdzv_timeout_s < math.inf:
        raise ConfigurationError(
            f"--rdzv-timeout must be a finite number of seconds > 0, got {topology.rdzv_timeout_s}.")
