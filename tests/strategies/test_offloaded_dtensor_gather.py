"""An offloaded DTensor (on the CPU, its mesh a CUDA one) is gathered on its mesh's device: NCCL cannot reduce
a CPU tensor (FSDP with CPU offload crashed at clipping and at `gpukit.save` of its optimizer on 2+ GPUs).
The NCCL failure needs 2 GPUs; here a real one-process gloo mesh checks the ordinary path, and a stand-in whose
mesh device differs from its own (as an offloaded DTensor's does) checks where the gather runs."""

from __future__ import annotations

import pytest
import torch

from gpukit._util.dtensor import full_tensor


class _Offloaded:
    """What full_tensor reads of a DTensor: device, device_mesh.device_type, to(), full_tensor()."""

    def __init__(self, value: torch.Tensor, mesh_device: str, log: list[str]) -> None:
        self.value, self.log = value, log
        self.device = value.device
        self.device_mesh = type("Mesh", (), {"device_type": mesh_device})()

    def to(self, device: str) -> _Offloaded:
        self.log.append(f"to {device}")
        moved = _Offloaded(self.value, self.device_mesh.device_type, self.log)
        moved.device = torch.device(device)
        return moved

    def full_tensor(self) -> torch.Tensor:
        self.log.append(f"gather on {self.device.type}")
        if self.device.type != self.device_mesh.device_type:
            raise RuntimeError("No backend type associated with device type cpu")  # what NCCL says
        return torch.ones(self.value.shape, device=self.device)


def test_an_offloaded_dtensor_is_gathered_on_its_meshs_device_and_comes_back() -> None:
    # no GPU here: "meta" stands for the offloaded tensor's CPU, "cpu" for its mesh's CUDA
    log: list[str] = []
    whole = full_tensor(_Offloaded(torch.empty(3, device="meta"), "cpu", log))
    assert log == ["to cpu", "gather on cpu"] and whole.device.type == "meta"  # back where the state lives
    log.clear()
    kept = full_tensor(_Offloaded(torch.empty(3, device="meta"), "cpu", log), back=False)  # a clipping norm
    assert log == ["to cpu", "gather on cpu"] and kept.device.type == "cpu"


@pytest.mark.requires_cpu_fsdp  # a DTensor on a CPU mesh: torch >= 2.7 (on 2.5.1 it hung in 1 of 3 floor runs, cause not found)
def test_a_dtensor_on_its_meshs_device_is_gathered_as_it_is() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        value = torch.arange(6.0)
        assert torch.equal(full_tensor(distribute_tensor(value, mesh, [Shard(0)])), value)
    finally:
        dist.destroy_process_group()
