"""Strategy selection rules (gpukit.strategies.select_strategy), without joining any group."""

from __future__ import annotations

import pytest
import torch

from gpukit.accelerators import CUDAAccelerator
from gpukit.errors import ConfigurationError, DeviceError, DistributedError
from gpukit.strategies import (
    DataParallelStrategy,
    DDPStrategy,
    DistEnv,
    SingleDeviceStrategy,
    select_strategy,
)


def torchrun_env(rank: int, world: int, local_world: int | None = None) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(local_world or world), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}


@pytest.fixture
def four_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CUDAAccelerator, "is_available", lambda self: True)
    monkeypatch.setattr(CUDAAccelerator, "device_count", lambda self: 4)


def test_plain_process_defaults_to_single_cpu() -> None:
    strategy = select_strategy(environ={}, accelerator="cpu")
    assert isinstance(strategy, SingleDeviceStrategy) and strategy.root_device == torch.device("cpu")


def test_torchrun_world_of_two_without_gpu_is_ddp_on_gloo() -> None:
    strategy = select_strategy(environ=torchrun_env(1, 2), accelerator="cpu")
    assert isinstance(strategy, DDPStrategy) and strategy.launched
    assert (strategy.rank, strategy.world_size) == (1, 2)
    assert strategy.accelerator.distributed_backend == "gloo"
    assert strategy.root_device == torch.device("cpu")


def test_torchrun_ranks_take_their_local_gpu(four_gpus: None) -> None:
    strategy = select_strategy(environ=torchrun_env(3, 4), accelerator="cuda")
    assert strategy.root_device == torch.device("cuda", 3)
    assert strategy.accelerator.distributed_backend == "nccl"


def test_devices_must_agree_with_the_launcher() -> None:
    with pytest.raises(ConfigurationError, match="LOCAL_WORLD_SIZE"):
        select_strategy(devices=3, accelerator="cpu", environ=torchrun_env(0, 2))


def test_several_gpus_without_launcher_is_unlaunched_ddp(four_gpus: None) -> None:
    strategy = select_strategy(devices=4, environ={}, accelerator="cuda")
    assert isinstance(strategy, DDPStrategy) and not strategy.launched
    assert strategy.num_processes == 4


def test_dp_puts_the_first_listed_gpu_first(four_gpus: None) -> None:
    strategy = select_strategy(devices=[2, 0], strategy="dp", environ={}, accelerator="cuda")
    assert isinstance(strategy, DataParallelStrategy)
    assert strategy.root_device == torch.device("cuda", 2)
    assert strategy.devices == [torch.device("cuda", 2), torch.device("cuda", 0)]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"devices": 2, "strategy": "single", "accelerator": "cpu"}, "strategy='single' uses one"),
        ({"devices": 2, "strategy": "dp", "accelerator": "cpu"}, "splits batches over GPUs"),
        ({"devices": [0, 1]}, "no GPU here"),
        ({"devices": "cpu", "accelerator": "cuda"}, "not available"),
    ],
)
def test_contradictions_are_errors(kwargs: dict, match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CUDAAccelerator, "is_available", lambda self: False)
    with pytest.raises((ConfigurationError, DeviceError), match=match):
        select_strategy(environ={}, **kwargs)


def test_dp_inside_a_launched_job_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="runs in one process"):
        select_strategy(strategy="dp", accelerator="cpu", environ=torchrun_env(0, 2))


def test_incomplete_launch_environment_is_explained() -> None:
    with pytest.raises(DistributedError, match="RANK and WORLD_SIZE must both"):
        DistEnv.from_environ({"WORLD_SIZE": "2"})
    with pytest.raises(DistributedError, match="outside"):
        DistEnv.from_environ({"WORLD_SIZE": "2", "RANK": "2"})
    assert DistEnv.from_environ({}) is None


class _RecordingDist:
    """Stands in for torch.distributed under nccl (not runnable without GPUs): records the calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def is_initialized(self) -> bool:
        return True

    def get_world_size(self) -> int:
        return 2

    def barrier(self, **kwargs: object) -> None:
        self.calls.append(("barrier", kwargs))

    def all_reduce(self, tensor: torch.Tensor, op: object = None) -> None:
        self.calls.append(("all_reduce", tensor.device))

    def all_gather(self, parts: list[torch.Tensor], tensor: torch.Tensor) -> None:
        self.calls.append(("all_gather", tensor.device))
        for part in parts:
            part.copy_(tensor)


def test_nccl_collectives_name_the_gpu_and_never_get_cpu_tensors(
    four_gpus: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gpukit.strategies.ddp as ddp_module

    strategy = select_strategy(environ=torchrun_env(1, 2), accelerator="cuda")
    assert strategy.root_device == torch.device("cuda", 1)
    fake = _RecordingDist()
    monkeypatch.setattr(ddp_module, "dist", fake)
    monkeypatch.setattr(ddp_module.dist, "ReduceOp", torch.distributed.ReduceOp, raising=False)
    # tensors cannot really be placed on a GPU here: record where they were sent instead
    moved: list[torch.device] = []
    real_to = torch.Tensor.to

    def to(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, torch.device) and target.type == "cuda":
            moved.append(target)
            return real_to(self, "cpu", copy=bool(kwargs.get("copy", False)))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    strategy.barrier()
    assert fake.calls[-1] == ("barrier", {"device_ids": [1]})
    strategy.all_reduce(torch.ones(3), op="sum")  # a CPU tensor: nccl would refuse it
    strategy.all_gather(torch.ones(2))
    assert moved[:2] == [torch.device("cuda", 1)] * 2


def test_processes_sharing_one_visible_gpu_use_its_cuda0_over_gloo(monkeypatch) -> None:
    # LOCAL_WORLD_SIZE=2 and one visible GPU, no scheduler binding a GPU per task (gpukit run --gpus 1
    # --nproc 2, torchrun on a one-GPU machine): both ranks on cuda:0; nccl refuses two ranks on one
    # device ("Duplicate GPU detected"), so the group is gloo, and the banner says why
    monkeypatch.setattr(CUDAAccelerator, "is_available", lambda self: True)
    monkeypatch.setattr(CUDAAccelerator, "device_count", lambda self: 1)
    strategy = select_strategy(environ=torchrun_env(1, 2), accelerator="cuda")
    assert isinstance(strategy, DDPStrategy) and strategy.root_device == torch.device("cuda", 0)
    assert strategy.backend == "gloo" and "2 processes share cuda:0: nccl needs a GPU per process" in strategy.describe()
    with pytest.raises(ConfigurationError, match=r"strategy='fsdp' needs a GPU per process.*gpukit run --gpus 2"):
        select_strategy(strategy="fsdp", environ=torchrun_env(1, 2), accelerator="cuda")
    with pytest.raises(DeviceError):  # an explicit count still has to be visible
        select_strategy(devices=2, environ=torchrun_env(1, 2), accelerator="cuda")
    monkeypatch.setattr(CUDAAccelerator, "device_count", lambda self: 2)  # a GPU each: nccl as always
    assert select_strategy(environ=torchrun_env(1, 2), accelerator="cuda").backend == "nccl"
