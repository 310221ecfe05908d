"""Worker for test_activation_checkpointing.py, started by `gpukit run --cpu --nproc 2` (gloo).

For ``strategy`` (argv[1]: ddp or fsdp) it trains the same model from the same seed twice,
without and with ``activation_checkpointing=True``, on this rank's batches, saves a gpukit
checkpoint of the second run, and writes <out>/rank<R>.pt with both runs' full weights,
their state_dict keys and the checkpointed block names.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import gpukit

FEATURES, STEPS = 8, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in gpukit.unwrap_model(model).state_dict().items()}


def train(strategy: str, checkpointing: object, out: Path | None) -> dict:
    session = gpukit.Session(accelerator="cpu", strategy=strategy, verbose=False,
                             activation_checkpointing=checkpointing)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = session.setup(model, optimizer)
    generator = torch.Generator().manual_seed(100 + session.rank)
    for _ in range(STEPS):
        x = torch.randn(6, FEATURES, generator=generator)
        loss = model(x).pow(2).mean()
        session.backward(loss)
        session.step(optimizer)
    if out is not None:
        session.save_checkpoint(out, step=STEPS, model=model, optimizer=optimizer)
    return {"state": full_state(model), "keys": list(gpukit.unwrap_model(model).state_dict()),
            "checkpointed": list(session.strategy.checkpointed), "rank": session.rank}


def main(strategy: str, out: Path) -> None:
    plain = train(strategy, None, None)
    checkpointed = train(strategy, True, out / "ckpt")
    torch.save({"plain": plain, "checkpointed": checkpointed}, out / f"rank{plain['rank']}.pt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
