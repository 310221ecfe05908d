"""`gpukit run` as a cluster node's agent: nodes, node rank, master and GPUs from the scheduler."""

from __future__ import annotations

import pytest

from gpukit.cluster import environment
from gpukit.errors import ConfigurationError
from gpukit.launch import Topology, node_topology, scheduler_gpu_count

NODE_1 = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
          "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_STEP_NUM_NODES": "2",
          "SLURM_STEP_NODELIST": "gpu-[07-08]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_GPUS": "4,5"}


def test_srun_gpukit_run_needs_no_flags() -> None:
    topology = node_topology(env=environment(NODE_1))
    assert topology == Topology(nnodes=2, node_rank=1, master_addr="gpu-07", master_port=19242)
    assert scheduler_gpu_count(environment(NODE_1)) == 2


def test_flags_given_win_over_the_scheduler() -> None:
    topology = node_topology(master_addr="10.0.0.1", master_port=29999, rdzv_timeout_s=5, env=environment(NODE_1))
    assert (topology.nnodes, topology.node_rank, topology.master_addr, topology.master_port) == (2, 1, "10.0.0.1", 29999)


def test_one_node_jobs_and_plain_machines_rendezvous_locally() -> None:
    one = {**NODE_1, "SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NUM_NODES": "1",
           "SLURM_STEP_NODELIST": "gpu-07", "SLURM_STEP_TASKS_PER_NODE": "1"}
    assert node_topology(env=environment(one)).single_machine
    assert node_topology(env=environment({})).single_machine
    assert scheduler_gpu_count(environment({})) is None


def test_several_gpukit_runs_per_node_are_refused_with_the_fix() -> None:
    crowded = {**NODE_1, "SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
               "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    with pytest.raises(ConfigurationError, match="--ntasks-per-node=1") as info:
        node_topology(env=environment(crowded))
    assert "gpu-08" in str(info.value)


def test_kubernetes_pod_is_a_node() -> None:
    pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456",
           "WORLD_SIZE": "2", "RANK": "1"}
    assert node_topology(env=environment(pod)) == Topology(nnodes=2, node_rank=1, master_addr="job-master-0",
                                                           master_port=23456)


def test_gpus_slurm_gave_are_used_and_never_widened(tmp_path, monkeypatch) -> None:
    from pathlib import Path

    from gpukit.errors import GpuSelectionError
    from gpukit.launch import GpuRequest, LaunchSpec
    from gpukit.launch._gpus import plan_devices

    spec = Path(__file__).resolve().parents[2] / "examples" / "fake-gpus" / "idle-8gpu.json"
    monkeypatch.setenv("GPUKIT_FAKE_GPUS", str(spec))
    monkeypatch.setenv("GPUKIT_CLAIM_DIR", str(tmp_path / "claims"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")  # as SLURM sets it with SLURM_STEP_GPUS=4,5
    plan = plan_devices(LaunchSpec(gpus=GpuRequest.of(scheduler_gpu_count(environment(NODE_1)))))
    try:
        assert plan.gpu_count == 2 and plan.env["CUDA_VISIBLE_DEVICES"] == "4,5"
    finally:
        plan.release()
    with pytest.raises(GpuSelectionError):  # a third GPU of the machine is not the job's
        plan_devices(LaunchSpec(gpus=GpuRequest(count=3)))
