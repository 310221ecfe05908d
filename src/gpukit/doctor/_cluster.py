"""Where the job runs (``gpukit.cluster.environment()``), and SLURM tasks that do not fit the GPUs."""

from __future__ import annotations

from gpukit.cluster import gpu_mismatch, shared_gpu_problem
from gpukit.devices import VISIBLE_DEVICES_ENV, resolve_visible
from gpukit.doctor._context import DoctorContext
from gpukit.doctor._finding import Finding

__all__ = ["check_cluster"]


def check_cluster(ctx: DoctorContext) -> list[Finding]:
    """What the cluster detector found; contradictory launcher variables; srun tasks vs GPUs."""
    name = "cluster.environment"
    if ctx.cluster is None:
        return [Finding(name, "fail", ctx.cluster_error or "the launch environment cannot be read",
                        "complete or unset the variables the message names", {"error": ctx.cluster_error})]
    env = ctx.cluster
    details = {"kind": env.kind, "nodes": env.nodes, "node_rank": env.node_rank, "rank": env.rank,
               "world_size": env.world_size, "local_rank": env.local_rank,
               "local_world_size": env.local_world_size, "master_addr": env.master_addr,
               "master_port": env.master_port, "job_id": env.job_id,
               "gpus": None if env.gpus is None else list(env.gpus), "restart_count": env.restart_count}
    findings = [Finding(name, "info", env.describe(), None, details)]
    if env.kind == "slurm" and env.in_step and ctx.gpus:
        visible = len(resolve_visible(ctx.env.get(VISIBLE_DEVICES_ENV), ctx.gpus))
        node = env.hosts[env.node_rank] if env.hosts else None
        problem = gpu_mismatch(env.local_world_size, visible, node)
        shared = shared_gpu_problem(env.local_world_size, visible, ctx.env, node)  # --gres=gpu:1, 4 tasks
        if problem or shared:
            problem = problem or shared
            fix = (f"srun --ntasks-per-node={visible} (one task per GPU) or --gpus-per-task=1"
                   if env.local_world_size > visible else f"srun --ntasks-per-node={visible}")
            findings.append(Finding("cluster.tasks", "warn", problem, fix,
                                    {"tasks_on_node": env.local_world_size, "gpus_visible": visible}))
    return findings
