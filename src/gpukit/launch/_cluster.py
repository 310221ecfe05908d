"""``gpukit run`` on a cluster: its node topology and default GPU count from the scheduler.

Under ``srun gpukit run train.py`` (one task per node) or in a Kubernetes PyTorchJob pod,
``gpukit run`` is the node's agent: the number of nodes, this node's rank and the master
address and port come from :func:`gpukit.cluster.environment`, so no ``--nnodes``/
``--node-rank``/``--master-addr`` is needed. A flag that is given wins over the detected value.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpukit.cluster import ClusterEnvironment, agent_tasks_problem, environment
from gpukit.errors import ConfigurationError
from gpukit.launch._elastic import Topology

__all__ = ["node_topology", "scheduler_gpu_count"]

_DEFAULT_PORT = 29500


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
