"""The cluster facts (gpukit.cluster.environment) in doctor: detection, bad variables, srun tasks vs GPUs,
and the master address / port a SLURM job derives."""

from __future__ import annotations

from gpukit.cluster import slurm_port
from gpukit.doctor._cluster import check_cluster
from gpukit.doctor._network import check_master, check_port

# an srun task: rank 1 of 8, 4 tasks on each of 2 nodes (localhost first, so the master is this machine)
STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost,n2",
        "SLURM_STEP_NODELIST": "localhost,n2", "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "4(x2)"}


def test_plain_machine_is_described(make_ctx):
    [finding] = check_cluster(make_ctx({}))
    assert finding.status == "info" and finding.details["kind"] == "local"


def test_srun_tasks_that_do_not_fit_the_gpus_warn(use_spec, make_ctx):
    use_spec("shared-4gpu")
    [info] = check_cluster(make_ctx(dict(STEP)))  # 4 tasks, 4 GPUs: fits
    assert info.details["kind"] == "slurm" and info.details["local_world_size"] == 4
    findings = check_cluster(make_ctx(dict(STEP, CUDA_VISIBLE_DEVICES="0,1")))
    [tasks] = [f for f in findings if f.name == "cluster.tasks"]
    assert tasks.status == "warn" and "share GPUs" in tasks.message and "--ntasks-per-node=2" in tasks.fix


def test_contradictory_launch_variables_fail(make_ctx):
    [finding] = check_cluster(make_ctx({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}))
    assert finding.status == "fail" and "RANK" in finding.message


def test_master_and_port_come_from_slurm_without_master_addr(make_ctx):
    ctx = make_ctx(dict(STEP))
    [master] = check_master(ctx)
    assert master.details["master_addr"] == "localhost" and master.details["source"] == "slurm detection"
    [port] = check_port(ctx)
    assert port.details["port"] == slurm_port(4242) and port.details["source"] == "slurm detection"
    # loopback as the master of a 2-node job cannot work
    assert master.status == "warn"


def test_gres_gpu_1_with_4_tasks_per_node_is_named(use_spec, make_ctx):
    # --gres=gpu:1 --ntasks-per-node=4: each task sees GPU 0 -- the same one, not one each
    use_spec("shared-4gpu")
    shared = dict(STEP, CUDA_VISIBLE_DEVICES="0", SLURM_STEP_GPUS="0", SLURM_GPUS_ON_NODE="1")
    [tasks] = [f for f in check_cluster(make_ctx(shared)) if f.name == "cluster.tasks"]
    assert tasks.status == "warn" and "SLURM gave the node 1 GPU(s)" in tasks.message
    assert "--gpus-per-task=1" in tasks.message
    # --gpus-per-task=1: one GPU each, the node has 4
    per_task = dict(STEP, CUDA_VISIBLE_DEVICES="1", SLURM_STEP_GPUS="0,1,2,3", SLURM_GPUS_PER_TASK="1")
    assert [f.name for f in check_cluster(make_ctx(per_task))] == ["cluster.environment"]
