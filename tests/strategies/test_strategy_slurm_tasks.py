"""`srun python train.py`: the Session takes its rank from SLURM and checks tasks against GPUs."""

from __future__ import annotations

import pytest
import torch

from gpukit.accelerators import CUDAAccelerator
from gpukit.errors import DeviceError
from gpukit.strategies import DDPStrategy, select_strategy


def _srun_task(local_id: int, tasks_per_node: int) -> dict[str, str]:
    return {"SLURM_JOB_ID": "31", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(tasks_per_node + local_id),
            "SLURM_NTASKS": str(2 * tasks_per_node), "SLURM_LOCALID": str(local_id), "SLURM_NODEID": "1",
            "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "g[1-2]",
            "SLURM_STEP_TASKS_PER_NODE": f"{tasks_per_node}(x2)"}


@pytest.fixture
def four_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CUDAAccelerator, "is_available", lambda self: True)
    monkeypatch.setattr(CUDAAccelerator, "device_count", lambda self: 4)


@pytest.mark.usefixtures("four_gpus")
def test_one_task_per_gpu_takes_rank_and_gpu_from_slurm() -> None:
    strategy = select_strategy(environ=_srun_task(3, 4), accelerator="cuda")
    assert isinstance(strategy, DDPStrategy)
    assert (strategy.rank, strategy.world_size, strategy.local_rank) == (7, 8, 3)
    assert strategy.root_device == torch.device("cuda", 3)
    assert strategy.env is not None and (strategy.env.master_addr, strategy.env.master_port) == ("g1", 15031)


@pytest.mark.usefixtures("four_gpus")
def test_more_tasks_than_gpus_is_refused_with_the_fix() -> None:
    with pytest.raises(DeviceError, match=r"--ntasks-per-node=4"):
        select_strategy(environ=_srun_task(0, 8), accelerator="cuda")


@pytest.mark.usefixtures("four_gpus")
def test_fewer_tasks_than_gpus_warns_that_gpus_sit_idle() -> None:
    with pytest.warns(RuntimeWarning, match="2 would sit idle"):
        select_strategy(environ=_srun_task(1, 2), accelerator="cuda")


@pytest.fixture
def one_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CUDAAccelerator, "is_available", lambda self: True)
    monkeypatch.setattr(CUDAAccelerator, "device_count", lambda self: 1)


@pytest.mark.usefixtures("one_visible_gpu")
def test_gres_gpu_1_with_4_tasks_is_refused_not_shared() -> None:
    # --gres=gpu:1 --ntasks-per-node=4: every task sees the node's one GPU
    with pytest.raises(DeviceError, match=r"SLURM gave the node 1 GPU\(s\).*--gpus-per-task=1"):
        select_strategy(environ={**_srun_task(2, 4), "SLURM_STEP_GPUS": "0"}, accelerator="cuda")
    # --gpus-per-task=1: each task sees its own GPU as cuda:0
    strategy = select_strategy(environ={**_srun_task(2, 4), "SLURM_STEP_GPUS": "0,1,2,3"}, accelerator="cuda")
    assert strategy.root_device == torch.device("cuda", 0)
