"""The 2-process job of the Session(fit=...) test (module level: spawned workers import it)."""

from __future__ import annotations

import os
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


def fsdp_micro_batch_job(split: bool) -> dict[str, Any]:
    """One FSDP rank's step over its batch of 64: ``split`` lets ``Session(fit=...)`` cut it into micro-batches
    (a budget between the planned peaks of micro-batch 32 and of the whole batch), else one plain step."""
    from gpukit.memory import fit

    torch.manual_seed(0)
    model = mlp(width=64, depth=2)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1 + int(os.environ["RANK"])))
    y = torch.randn(64, 10, generator=torch.Generator().manual_seed(11 + int(os.environ["RANK"])))
    budget = None
    if split:
        planned = {o.micro_batch: o.peak_bytes for o in fit(model, torch.empty(64, 64), memory="1TiB", devices=2,
                                                            global_batch=128, strategies=["fsdp"], top=20,
                                                            precisions=["32-true"], checkpointing=["none"],
                                                            device="cpu", optimizer="sgd").options}
        assert planned[32] < planned[64], planned
        budget = (planned[32] + planned[64]) // 2
    session = gpukit.Session(accelerator="cpu", strategy="fsdp", precision="32-true", activation_checkpointing=False,
                             seed=0, verbose=False, fit=budget)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = session.setup(model, optimizer, **({"example_input": x} if split else {}))
    session.run_step(lambda b: F.mse_loss(model(b[0]), b[1]), (x, y))
    session.step(optimizer)
    micro = session.fit_choice.micro_batch if session.fit_choice is not None else None
    return {"rank": session.rank, "micro_batch": micro,
            "params": [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                       for p in gpukit.unwrap_model(model).parameters()]}
