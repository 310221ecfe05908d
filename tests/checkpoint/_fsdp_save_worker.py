"""Worker for test_ckpt_fsdp_save.py (``gpukit run --cpu --nproc 2``): gpukit.save of an FSDP model.

Trains one step under Session(strategy="fsdp"), then saves the model, its state_dict() (DTensors)
and export_pretrained's folder, and writes the full parameters gathered by torch's own API as the
reference (``OUT/reference.pt``, rank 0).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import gpukit
from gpukit.checkpoint import export_pretrained


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Sequential(*[nn.Linear(16, 16) for _ in range(2)]), nn.Linear(16, 2))


def main(out: Path) -> None:
    session = gpukit.Session(accelerator="cpu", strategy="fsdp", seed=0, verbose=False)
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = session.setup(model, optimizer)
    session.backward(model(torch.randn(4, 6) + session.rank).pow(2).mean())
    session.step(optimizer)
    gpukit.save(model, out / "model.pt")
    gpukit.save(model, out / "model.safetensors")
    gpukit.save({"model": model.state_dict(), "step": 1}, out / "state.pt")  # DTensors inside
    export_pretrained(model, out / "export")
    reference = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if session.is_main:
        torch.save({k: v.clone() for k, v in reference.items()}, out / "reference.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
