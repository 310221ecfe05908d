"""On a GPU machine: gpukit's snapshots agree with nvidia-smi, and the numbering with CUDA's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from gpukit.devices import list_gpus, use_gpus

MIB = 2**20


def _nvidia_smi() -> list[list[str]]:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi is not installed")
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,uuid,name,pci.bus_id,memory.total,memory.used",
         "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=60, check=True)
    return [[field.strip() for field in line.split(",")] for line in out.stdout.strip().splitlines()]


@pytest.mark.requires_gpu
def test_snapshot_matches_nvidia_smi() -> None:
    rows = _nvidia_smi()
    gpus = list_gpus()
    assert len(gpus) == len(rows)
    for gpu, (index, uuid, name, bus_id, total_mib, used_mib) in zip(gpus, rows, strict=True):
        assert gpu.usable, gpu.error
        assert (gpu.index, gpu.uuid, gpu.name) == (int(index), uuid, name)
        assert (gpu.pci_bus_id or "").lower() == bus_id.lower()
        assert gpu.memory_total_bytes // MIB == int(total_mib)
        # memory in use moves between the two reads; allow a little drift
        assert abs(gpu.memory_used_bytes // MIB - int(used_mib)) <= max(256, int(total_mib) // 50)
        assert 0 <= gpu.memory_free_bytes <= gpu.memory_total_bytes


@pytest.mark.requires_gpu
def test_use_gpus_makes_cuda_0_the_chosen_physical_gpu() -> None:
    gpus = [g for g in list_gpus() if g.usable and not g.mig_enabled]
    target = gpus[-1]
    env = dict(os.environ)
    use_gpus([target], env=env)
    script = "import torch; print(torch.cuda.device_count()); print(torch.cuda.get_device_properties(0).uuid)"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    count, uuid = out.stdout.split()
    assert count == "1"
    assert target.uuid == f"GPU-{uuid}" or target.uuid == uuid
