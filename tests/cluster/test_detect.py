"""gpukit.cluster.environment() under controlled environments (the real SLURM cluster is in
test_slurm_cluster.py)."""

from __future__ import annotations

import pytest

from gpukit.cluster import PORT_BASE, PORT_SPAN, agent_tasks_problem, environment, gpu_mismatch, slurm_port
from gpukit.errors import ConfigurationError, DistributedError
from gpukit.strategies import DistEnv

# what srun sets for task 3 of `srun -N2 --ntasks-per-node=2` in job 4242 (trimmed)
SRUN_TASK = {
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "2", "SLURM_STEP_NUM_NODES": "2",
    "SLURM_JOB_NODELIST": "gpu-[07-08]", "SLURM_STEP_NODELIST": "gpu-[07-08]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_GPUS": "2,3",
    "SLURM_JOB_GPUS": "2,3", "SLURM_RESTART_COUNT": "1",
}


def test_plain_machine_is_local() -> None:
    env = environment({"PATH": "/usr/bin"})
    assert env.kind == "local" and not env.distributed
    assert (env.rank, env.world_size, env.nodes, env.master_addr) == (0, 1, 1, None)
    assert env.torch_variables() == {} and DistEnv.from_environ({}) is None


def test_srun_task_takes_ranks_master_and_port_from_slurm() -> None:
    env = environment(SRUN_TASK)
    assert env.kind == "slurm" and env.in_step and env.distributed
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert (env.node_rank, env.nodes, env.hosts) == (1, 2, ("gpu-07", "gpu-08"))
    assert env.master_addr == "gpu-07" and env.master_port == PORT_BASE + 4242 % PORT_SPAN
    assert env.job_id == "4242" and env.gpus == ("2", "3") and env.restart_count == 1
    assert env.torch_variables() == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu-07", "MASTER_PORT": str(PORT_BASE + 4242 % PORT_SPAN),
    }
    assert "SLURM job 4242" in env.describe() and "rank 3 of 4" in env.describe()


def test_master_addr_and_port_set_in_the_job_script_win() -> None:
    env = environment({**SRUN_TASK, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "23456"})
    assert (env.master_addr, env.master_port) == ("10.0.0.5", 23456)


def test_uneven_tasks_per_node() -> None:
    env = environment({**SRUN_TASK, "SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_PROCID": "3",
                       "SLURM_LOCALID": "0"})
    assert env.local_world_size == 1


def test_batch_script_is_slurm_but_not_a_rank() -> None:
    batch = {k: v for k, v in SRUN_TASK.items() if not k.startswith("SLURM_STEP")}
    env = environment({**batch, "SLURM_PROCID": "0"})
    assert env.kind == "slurm" and not env.in_step and not env.distributed
    assert (env.world_size, env.nodes, env.master_addr) == (1, 2, "gpu-07")
    assert "batch script" in env.describe() and DistEnv.from_environ({**batch, "SLURM_PROCID": "0"}) is None


def test_session_exported_variables_keep_it_slurm() -> None:
    # A Session under `srun python` exports RANK... from SLURM; detection must not change.
    env = environment({**SRUN_TASK, **environment(SRUN_TASK).torch_variables()})
    assert env.kind == "slurm" and env.rank == 3


def test_workers_of_srun_gpukit_run_are_launched_by_it() -> None:
    worker = {**SRUN_TASK, "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
              "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "gpu-07", "MASTER_PORT": "40000",
              "TORCHELASTIC_RUN_ID": "gpukit-16242"}
    env = environment(worker)
    assert env.kind == "torchrun"
    assert (env.rank, env.world_size, env.local_rank, env.node_rank, env.nodes) == (5, 8, 1, 1, 2)
    assert env.job_id == "4242" and env.gpus == ("2", "3")  # the scheduler's facts are kept


def test_kubernetes_pytorchjob_pod() -> None:
    pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456",
           "WORLD_SIZE": "3", "RANK": "2"}
    env = environment(pod)
    assert env.kind == "kubernetes" and env.distributed
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (2, 3, 0, 1)
    assert (env.node_rank, env.nodes, env.master_addr, env.master_port) == (2, 3, "job-master-0", 23456)
    per_node = environment({**pod, "PET_NNODES": "3", "PET_NODE_RANK": "2", "PET_NPROC_PER_NODE": "4"})
    assert (per_node.nodes, per_node.node_rank) == (3, 2)


def test_torchrun_variables_alone() -> None:
    env = environment({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29500"})
    assert env.kind == "torchrun" and (env.rank, env.local_world_size, env.nodes) == (1, 2, 1)
    dist = DistEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert dist is not None and (dist.rank, dist.kind) == (1, "torchrun")


@pytest.mark.parametrize("bad", [{"RANK": "0"}, {"RANK": "x", "WORLD_SIZE": "2"}, {"RANK": "2", "WORLD_SIZE": "2"}])
def test_broken_launcher_variables(bad: dict[str, str]) -> None:
    with pytest.raises(DistributedError, match="RANK"):
        environment(bad)


def test_broken_slurm_variables_say_which() -> None:
    with pytest.raises(ConfigurationError, match="SLURM_PROCID=7 of 4"):
        environment({**SRUN_TASK, "SLURM_PROCID": "7"})
    with pytest.raises(ConfigurationError, match="SLURM_NTASKS='four'"):
        environment({**SRUN_TASK, "SLURM_NTASKS": "four", "SLURM_STEP_NUM_TASKS": ""})
    with pytest.raises(ConfigurationError, match="node list"):
        environment({**SRUN_TASK, "SLURM_STEP_NODELIST": "gpu-[07"})


def test_dist_env_export_fills_only_missing_variables() -> None:
    dist = DistEnv.from_environ(SRUN_TASK)
    assert dist is not None and dist.kind == "slurm"
    target = {"MASTER_PORT": "1234"}
    dist.export(target)
    assert target["RANK"] == "3" and target["MASTER_ADDR"] == "gpu-07" and target["MASTER_PORT"] == "1234"


def test_port_from_job_id() -> None:
    assert slurm_port(4242) == 19242 and slurm_port("20000") == PORT_BASE and slurm_port("123_4") == 15123
    with pytest.raises(ConfigurationError, match="MASTER_PORT"):
        slurm_port("abc")


def test_task_and_gpu_mismatches_name_the_fix() -> None:
    assert gpu_mismatch(4, 4) is None and gpu_mismatch(4, 1) is None
    assert "--ntasks-per-node=2" in (gpu_mismatch(4, 2, "gpu-07") or "")
    assert "idle" in (gpu_mismatch(2, 4) or "")
    assert agent_tasks_problem(1) is None
    assert "--ntasks-per-node=1" in (agent_tasks_problem(2) or "")


# -- hostile values: every variable checked, every error naming it (issue 16.4) ---------------------

def _step(**extra: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
            "SLURM_JOB_NODELIST": "n1", **extra}


@pytest.mark.parametrize(
    ("env", "named"),
    [
        (_step(SLURM_JOB_NODELIST="n[1-999999999]"), "n[1-999999999]"),
        (_step(SLURM_JOB_NODELIST="n[1-" + "9" * 25 + "]"), "above"),
        (_step(SLURM_STEP_TASKS_PER_NODE="2(x99999999999),1"), "SLURM_STEP_TASKS_PER_NODE"),
        (_step(SLURM_STEP_TASKS_PER_NODE="2(x" + "9" * 400 + ")"), "SLURM_STEP_TASKS_PER_NODE"),
        ({"SLURM_JOB_ID": "abc"}, "SLURM_JOB_ID='abc'"),
        ({"SLURM_JOB_ID": "-1"}, "SLURM_JOB_ID='-1'"),
        ({"SLURM_JOB_ID": "1e309"}, "SLURM_JOB_ID='1e309'"),
        (_step(MASTER_PORT="9" * 400), "MASTER_PORT="),
        (_step(MASTER_ADDR="a..b"), "MASTER_ADDR='a..b'"),
        (_step(SLURM_NTASKS="9" * 5000), "SLURM_NTASKS="),
        (_step(SLURM_JOB_NODELIST="a..b"), "the first host of SLURM_JOB_NODELIST"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "1e309"}, "MASTER_PORT='1e309'"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "."}, "MASTER_ADDR='.'"),
        ({"RANK": "0", "WORLD_SIZE": "9" * 400, "LOCAL_RANK": "0"}, "WORLD_SIZE="),
    ],
)
def test_hostile_variables_are_errors_that_name_them(env: dict[str, str], named: str) -> None:
    import time

    from gpukit.errors import GpukitError

    started = time.monotonic()
    with pytest.raises(GpukitError) as info:
        environment(env)
    assert named in str(info.value) and "MASTER_PORT=None" not in str(info.value)
    assert time.monotonic() - started < 1.0


def test_tasks_per_node_is_read_without_expanding_repeats() -> None:
    from gpukit.cluster._slurm import tasks_per_node

    counts = tasks_per_node("2(x60000),1")
    assert len(counts) == 60001 and counts[0] == 2 and counts[59999] == 2 and counts[60000] == 1
    assert counts.runs == [(2, 60000), (1, 1)] and counts[-1] == 1
    env = _step(SLURM_STEP_TASKS_PER_NODE="3(x200000)", SLURM_NTASKS="600000", SLURM_PROCID="599999",
                SLURM_NODEID="199999", SLURM_LOCALID="2", SLURM_STEP_NUM_NODES="200000")
    detected = environment(env)
    assert detected.local_world_size == 3 and detected.node_rank == 199999


def test_the_job_is_announced_once_on_rank_0_but_not_by_gpukit_run_workers(capsys: pytest.CaptureFixture[str]) -> None:
    from gpukit.cluster import announce

    worker = environment({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert worker.kind == "torchrun"
    assert not announce(worker, force=True, under_gpukit=True)  # its launcher already said it
    assert announce(worker, force=True) and "gpukit: " in capsys.readouterr().err
    assert not announce(environment({}), force=True)  # a plain machine: nothing to say
