"""SLURM: where a task sits (from ``SLURM_*`` variables), the rendezvous port, and task/GPU checks.

Two ways to run under SLURM, both without gpukit flags:

* ``srun gpukit run train.py`` -- one task per node: ``gpukit run`` is the node's agent and
  takes the node count, node rank and master from SLURM (this module), then starts one worker
  per GPU itself;
* ``srun python train.py`` -- one task per GPU (``--ntasks-per-node`` = GPUs per node): each
  task is a rank, and a Session sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/
  ``MASTER_PORT`` from SLURM before joining the process group.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import overload

from gpukit._util.units import whole_number
from gpukit.cluster._nodelist import MAX_HOSTS, parse_nodelist
from gpukit.cluster._vars import check_host, env_host, env_int, env_port
from gpukit.errors import ConfigurationError

__all__ = [
    "PORT_BASE",
    "PORT_SPAN",
    "slurm_port",
    "tasks_per_node",
    "TasksPerNode",
    "in_slurm_job",
    "in_slurm_step",
    "slurm_gpus",
    "shared_gpu_problem",
    "gpu_mismatch",
    "agent_tasks_problem",
    "read_slurm",
]

#: ``MASTER_PORT`` under SLURM, unless set: ``PORT_BASE + job_id % PORT_SPAN`` (15000..34999).
#: Every task of a job computes the same port; jobs sharing a node get different ones unless
#: their ids differ by a multiple of 20000. Set ``MASTER_PORT`` in the job script to choose.
PORT_BASE = 15000
PORT_SPAN = 20000

_TASKS = re.compile(r"^(\d{1,6})(?:\(x(\d{1,12})\))?$")
_JOB_ID = re.compile(r"^\d{1,10}$")
_MAX_TASKS_TEXT = 100_000  # characters of SLURM_TASKS_PER_NODE read
#: most tasks SLURM_TASKS_PER_NODE may describe (repeats included): more nodes than a list can name
MAX_NODES = MAX_HOSTS


def slurm_port(job_id: str | int) -> int:
    """The rendezvous port every task of job ``job_id`` derives: ``15000 + job_id % 20000``.

    Raises:
        ConfigurationError: ``job_id`` is not a number (an array job's ``123_4`` uses 123).
    """
    text = str(job_id).split("_")[0].strip()
    if not _JOB_ID.match(text):
        shown = str(job_id) if len(str(job_id)) <= 40 else str(job_id)[:40] + "..."
        raise ConfigurationError(
            f"SLURM_JOB_ID={shown!r} is not a SLURM job id (a number of at most 10 digits), so no rendezvous "
            "port can be derived from it; set MASTER_PORT in the job script (or unset SLURM_JOB_ID outside SLURM)."
        )
    return PORT_BASE + int(text) % PORT_SPAN


class TasksPerNode(Sequence[int]):
    """``SLURM_TASKS_PER_NODE`` as a sequence of per-node counts, kept compressed.

    ``2(x99999)`` is one run, not a list of 99,999 numbers: indexing walks the runs.
    """

    def __init__(self, runs: list[tuple[int, int]]) -> None:
        self.runs = runs  # (tasks, nodes) pairs, in node order

    def __len__(self) -> int:
        return sum(nodes for _, nodes in self.runs)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        for tasks, nodes in self.runs:
            if 0 <= index < nodes:
                return tasks
            index -= nodes
        raise IndexError("node index out of range")

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, (list, TasksPerNode)) else NotImplemented

    def __repr__(self) -> str:
        return f"TasksPerNode({self.runs})"


def tasks_per_node(text: str, variable: str = "SLURM_TASKS_PER_NODE") -> TasksPerNode:
    """Read ``SLURM_TASKS_PER_NODE`` (``"2(x3),1"`` -> ``[2, 2, 2, 1]``), without expanding repeats.

    Raises:
        ConfigurationError: text not in SLURM's ``N`` / ``N(xM)`` comma-separated form, or
            describing more than :data:`MAX_NODES` nodes.
    """
    shown = text if len(text) <= 80 else text[:80] + "..."
    runs: list[tuple[int, int]] = []
    for item in text.split(",") if len(text) <= _MAX_TASKS_TEXT else [""]:
        match = _TASKS.match(item.strip())
        if not match:
            raise ConfigurationError(
                f"Cannot read {variable}={shown!r}: expected counts like '2(x3),1' (tasks per node, "
                "with (xN) for N nodes alike). SLURM sets it; unset it if a job script overrode it."
            )
        runs.append((int(match.group(1)), int(match.group(2) or 1)))
    counts = TasksPerNode(runs)
    if len(counts) > MAX_NODES:
        raise ConfigurationError(f"{variable}={shown!r} describes {len(counts):,} nodes; gpukit reads at most "
                                 f"{MAX_NODES:,}. SLURM sets it; unset it if a job script overrode it.")
    return counts


def in_slurm_job(env: Mapping[str, str]) -> bool:
    """Inside a SLURM allocation (batch script, ``salloc`` shell or ``srun`` task)."""
    return bool(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"))


def in_slurm_step(env: Mapping[str, str]) -> bool:
    """Inside an ``srun`` task (a job step), where ``SLURM_PROCID`` etc. describe this task.

    The batch script itself is the "batch" step: it runs once, on the first node only.
    """
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    return in_slurm_job(env) and step is not None and whole_number(step) is not None and "SLURM_PROCID" in env


def slurm_gpus(env: Mapping[str, str]) -> tuple[str, ...] | None:
    """GPUs SLURM gave this step (or job) on this node, as SLURM names them; ``None``: no GPU gres."""
    for key in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        value = env.get(key)
        if value is not None and value.strip():
            return tuple(item.strip() for item in value.split(",") if item.strip())
    return None


def _int(env: Mapping[str, str], *keys: str, default: int | None = None, low: int = 0,
         high: int = 2**31 - 1) -> int:
    return env_int(env, *keys, default=default, low=low, high=high,
                   hint="SLURM sets it; a job script that overrides it must give such an integer (or unset it).")


def read_slurm(env: Mapping[str, str]) -> dict[str, object]:
    """The fields of a ``ClusterEnvironment`` for a SLURM job (see ``gpukit.cluster``)."""
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or ""
    step = in_slurm_step(env)
    list_key = next((key for key in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                     if env.get(key) and (step or key != "SLURM_STEP_NODELIST")), "SLURM_JOB_NODELIST")
    nodelist_text = env.get(list_key)
    hosts = tuple(parse_nodelist(nodelist_text)) if nodelist_text else ()
    if step:
        nodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", default=max(1, len(hosts)),
                     low=1, high=MAX_NODES)
        node_rank = _int(env, "SLURM_NODEID", default=0, high=MAX_NODES)
        world_size = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS", default=nodes, low=1)
        rank = _int(env, "SLURM_PROCID")
        local_rank = _int(env, "SLURM_LOCALID", default=0)
        per_node_key = "SLURM_STEP_TASKS_PER_NODE" if env.get("SLURM_STEP_TASKS_PER_NODE") else "SLURM_TASKS_PER_NODE"
        per_node_text = env.get(per_node_key)
        per_node = (tasks_per_node(per_node_text, per_node_key) if per_node_text
                    else TasksPerNode([(max(1, world_size // nodes), nodes)]))
        local_world_size = per_node[node_rank] if node_rank < len(per_node) else per_node[-1]
    else:  # the batch script (or an salloc shell): this one process, on the first node
        nodes = _int(env, "SLURM_JOB_NUM_NODES", "SLURM_NNODES", default=max(1, len(hosts)), low=1, high=MAX_NODES)
        node_rank, world_size, rank, local_rank, local_world_size = 0, 1, 0, 0, 1
    if not 0 <= rank < world_size or not 0 <= node_rank < nodes or not 0 <= local_rank < local_world_size:
        raise ConfigurationError(
            f"Inconsistent SLURM task variables: SLURM_PROCID={rank} of {world_size} tasks, "
            f"SLURM_NODEID={node_rank} of {nodes} nodes, SLURM_LOCALID={local_rank} of "
            f"{local_world_size} on this node. Do not override SLURM_* variables in the job script."
        )
    master_port = env_port(env, "MASTER_PORT")
    if master_port is None and job_id:
        master_port = slurm_port(job_id)
    return dict(
        nodes=nodes, node_rank=node_rank, world_size=world_size, rank=rank, local_rank=local_rank,
        local_world_size=local_world_size,
        master_addr=env_host(env, "MASTER_ADDR") or (check_host(hosts[0], f"the first host of {list_key}") if hosts
                                                     else None),
        master_port=master_port, hosts=hosts, in_step=step,
    )


def gpu_mismatch(tasks_on_node: int, gpus_visible: int, node: str | None = None) -> str | None:
    """What is wrong when ``srun`` started ``tasks_on_node`` tasks (one rank each) on a node
    whose every task sees ``gpus_visible`` GPUs, with the fix; ``None`` when they fit.

    One GPU per task (``--gpus-per-task=1``) or as many tasks as GPUs both fit.
    """
    if gpus_visible <= 1 or tasks_on_node == gpus_visible:
        return None
    where = f"on node {node} " if node else ""
    if tasks_on_node > gpus_visible:
        return (
            f"srun started {tasks_on_node} tasks {where}but each sees only {gpus_visible} GPUs, so "
            f"tasks would share GPUs. Use `srun --ntasks-per-node={gpus_visible}` (one task per GPU), "
            "or `--gpus-per-task=1`."
        )
    return (
        f"srun started {tasks_on_node} task(s) {where}but {gpus_visible} GPUs are visible: "
        f"{gpus_visible - tasks_on_node} would sit idle. Use `srun --ntasks-per-node={gpus_visible}`, "
        f"or ask for --gpus-per-node={tasks_on_node}."
    )


def shared_gpu_problem(tasks_on_node: int, gpus_visible: int, env: Mapping[str, str],
                       node: str | None = None) -> str | None:
    """Several tasks on a node that each see one GPU, while SLURM gave the node fewer GPUs than
    tasks (``--gres=gpu:1 --ntasks-per-node=4``): every task sees *the same* GPU, not one of its
    own as under ``--gpus-per-task=1``. The problem, with the fix; ``None`` when it fits or when
    SLURM does not say how many GPUs the node has (``SLURM_STEP_GPUS``/``SLURM_JOB_GPUS``/
    ``SLURM_GPUS_ON_NODE``)."""
    if tasks_on_node <= 1 or gpus_visible != 1:
        return None
    given = slurm_gpus(env)
    on_node = len(given) if given is not None else None
    if on_node is None:
        on_node = whole_number(env.get("SLURM_GPUS_ON_NODE", ""))
    if on_node is None or on_node >= tasks_on_node:
        return None
    where = f"on node {node} " if node else ""
    return (
        f"srun started {tasks_on_node} tasks {where}but SLURM gave the node {on_node} GPU(s), so all "
        f"{tasks_on_node} would share the one each task sees (not one GPU each, as with --gpus-per-task=1). "
        f"Ask for a GPU per task (`--gpus-per-task=1`, or `--gres=gpu:{tasks_on_node}`), or run "
        f"`--ntasks-per-node={on_node}`."
    )


def agent_tasks_problem(tasks_on_node: int, node: str | None = None) -> str | None:
    """Why ``srun gpukit run`` with several tasks on a node is wrong, with the fix; else ``None``."""
    if tasks_on_node <= 1:
        return None
    where = f" on node {node}" if node else ""
    return (
        f"srun started {tasks_on_node} copies of `gpukit run`{where} (--ntasks-per-node={tasks_on_node}). "
        "`gpukit run` is the node's agent and starts one worker per GPU itself (--nproc). Use "
        "`srun --ntasks-per-node=1 gpukit run ...`, or leave gpukit run out: "
        f"`srun --ntasks-per-node={tasks_on_node} python train.py`."
    )
