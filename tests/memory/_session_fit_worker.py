"""The 2-process job of the Session(fit=...) test (module level: spawned workers import it)."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

import gpukit
from planner_models import mlp


def fit_job(budget: int) -> dict[str, Any]:
    """One rank: rank 1's example batch is 4x rank 0's, so a rank deciding alone would differ."""
    session = gpukit.Session(accelerator="cpu", seed=0, verbose=False, fit=budget)
    torch.manual_seed(0)
    model = mlp(width=256, depth=6)
    optimizer = torch.optim.Adam(model.parameters())
    size = 512 if session.rank == 0 else 2048
    model, optimizer = session.setup(model, optimizer, example_input=torch.randn(size, 64))
    x, y = torch.randn(512, 64), torch.randn(512, 10)
    session.run_step(lambda b: F.mse_loss(model(b[0]).float(), b[1]), (x, y))
    session.step(optimizer)
    choice = session.fit_choice
    inner = gpukit.unwrap_model(model)
    return {"rank": session.rank, "choice": (choice.precision, choice.option.activation_checkpointing,
                                              choice.micro_batch, choice.peak_bytes),
            "dtype": str(next(inner.parameters()).dtype), "checkpointed": len(session.strategy.checkpointed),
            "params": [p.detach().float().clone() for p in inner.parameters()]}
