"""Worker for test_tensor_parallel_multiprocess.py's same-start test (`gpukit run --cpu --nproc 4`, gloo).

argv: <out dir> <strategy>. Each rank builds the model from a seed of its own (a script without
``Session(seed=...)``): a layer left whole (``nn.MultiheadAttention``) beside split ones. After ``setup`` under
``tensor_parallel=2``, writes <out>/init-rank<R>.pt: the values this rank built and the ones it holds
(each parameter made full over the mesh: over its tensor group, and over "dp" where sharded).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn

import gpukit


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.mix = nn.MultiheadAttention(8, 2, batch_first=True)  # fused q/k/v: left whole
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.mlp(h)
        return self.head(h + self.mix(h, h, h, need_weights=False)[0])


def main(out: Path, strategy: str) -> None:
    torch.manual_seed(1000 + int(os.environ["RANK"]))
    model = Net()
    built = {n: p.detach().clone() for n, p in model.named_parameters()}
    session = gpukit.Session(accelerator="cpu", tensor_parallel=2, strategy=strategy, verbose=False)
    model = session.setup(model)
    held = {}
    for name, param in gpukit.unwrap_model(model).named_parameters():
        held[name] = (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()
    torch.save({"built": built, "held": held}, out / f"init-rank{session.rank}.pt")
    session.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
