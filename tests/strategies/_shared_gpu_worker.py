"""Worker of test_ddp_on_a_shared_gpu.py: `gpukit run --gpus 1 --nproc 2` -- two ranks, one GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import gpukit

out = Path(sys.argv[1])
session = gpukit.Session(strategy="ddp", precision="32-true", seed=0)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
for step in range(3):
    g = torch.Generator().manual_seed(100 * step + session.rank)  # each rank its own batch
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    session.run_step(lambda b: nn.functional.mse_loss(model(b[0]), b[1]), (x, y))
    session.step(optimizer)
state = {k: v.detach().cpu() for k, v in gpukit.unwrap_model(model).state_dict().items()}
torch.save({"state": state, "device": str(session.device), "backend": session.strategy.backend},
           out / f"rank{session.rank}.pt")
session.close()
