"""Shared pieces of the Session memory tests: a model that runs "out of memory" on demand,
data, a plain reference loop, and the 2-process DDP job (module level: spawned workers import it)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.nn import functional as F

import gpukit

IN, OUT = 6, 3


class _OomInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # the layers after this one already accumulated their gradients: a partial backward
        raise torch.OutOfMemoryError("injected: CUDA out of memory (backward)")


class OomAbove(nn.Module):
    """Identity that raises torch.OutOfMemoryError for batches above ``limit`` while ``armed``,
    in the forward or half-way through the backward, as a real device would."""

    def __init__(self, limit: int, where: str = "forward") -> None:
        super().__init__()
        self.limit, self.where, self.armed, self.raised = limit, where, False, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.armed or x.shape[0] <= self.limit or is_fake(x):  # the planner's fake tensors pass
            return x
        self.raised += 1
        if self.where == "forward":
            torch.empty(x.shape[0], 4096)  # what the failed forward held
            raise torch.OutOfMemoryError("injected: CUDA out of memory (forward)")
        return _OomInBackward.apply(x)


def make_model(limit: int = 10**9, where: str = "forward") -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 12), OomAbove(limit, where), nn.Tanh(), nn.Linear(12, OUT))


def make_batch(step: int, rank: int = 0, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(size, IN, generator=generator), torch.randn(size, OUT, generator=generator)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train_reference(batches: list[tuple[torch.Tensor, torch.Tensor]], accumulate: int) -> list[torch.Tensor]:
    """The plain PyTorch loop: mean loss / accumulate, step every ``accumulate`` batches."""
    model = make_model()
    optimizer = make_optimizer(model)
    for i, (x, y) in enumerate(batches):
        (F.mse_loss(model(x), y) / accumulate).backward()
        if (i + 1) % accumulate == 0:
            optimizer.step()
            optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def ddp_job(steps: int, accumulate: int, oom_rank: int) -> dict[str, Any]:
    """One rank of the DDP test: rank ``oom_rank`` runs out of memory above 4 items."""
    session = gpukit.Session(
        accelerator="cpu", seed=0, verbose=False, oom="backoff", accumulate_grad_batches=accumulate
    )
    model = make_model(limit=4)
    model[1].armed = session.rank == oom_rank
    model, optimizer = session.setup(model, make_optimizer(model))

    def step_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(model(batch[0]), batch[1])

    losses = []
    for step in range(steps):
        losses.append(float(session.run_step(step_fn, make_batch(step, session.rank))))
        session.step(optimizer)
    backoff = session.oom_backoff
    assert backoff is not None
    result = {
        "rank": session.rank,
        "micro_batch_size": backoff.micro_batch_size,
        "accumulation_steps": backoff.accumulation_steps,
        "events": [(e.old_micro_batch_size, e.new_micro_batch_size, e.ranks_out_of_memory) for e in backoff.events],
        "raised": gpukit.unwrap_model(model)[1].raised,
        "optimizer_steps": session.optimizer_steps,
        "params": [p.detach().clone() for p in model.parameters()],
        "losses": losses,
    }
    session.barrier()  # neither rank leaves gloo while the other still talks to it
    session.close()
    return result
