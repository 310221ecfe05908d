"""Worker for test_compile.py: train a tiny model compiled under a strategy, count the graphs.

Usage: ``_compile_worker.py OUT STRATEGY HOW [gpu]`` where HOW is ``user`` (``torch.compile(model)``
before ``session.setup``) or ``session`` (``Session(compile=True)``); started directly for
``single`` and by ``gpukit run --cpu --nproc 2`` for ``ddp`` / ``fsdp``. Writes
``OUT/rank<R>.json`` (graphs compiled, losses, the returned model's type) and the weights
(``OUT/export/model.safetensors``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

import gpukit
from gpukit.checkpoint import export_pretrained


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(x))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleList(Block() for _ in range(2))  # FSDP: each block is a unit
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def main(out: Path, strategy: str, how: str, accelerator: str = "cpu") -> None:
    from torch._dynamo.utils import counters

    session = gpukit.Session(accelerator=accelerator, strategy=strategy, seed=0, verbose=False,
                             compile=True if how == "session" else None)
    torch.manual_seed(0)
    model = Tiny()
    if how == "user":
        model = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = session.setup(model, optimizer)
    g = torch.Generator().manual_seed(session.rank)
    losses = []
    for _ in range(2):
        x, y = (t.to(session.device) for t in (torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)))
        loss = nn.functional.mse_loss(model(x), y)
        session.backward(loss)
        session.step(optimizer)
        losses.append(loss.item())
    # collective: an FSDP model is gathered, rank 0 writes (gpukit.save would keep rank 0's shards)
    export_pretrained(model, out / "export")
    record = {"graphs": counters["stats"]["unique_graphs"], "losses": losses,
              "returned": type(model).__name__}
    (out / f"rank{session.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3], "auto" if sys.argv[4:] == ["gpu"] else "cpu")
