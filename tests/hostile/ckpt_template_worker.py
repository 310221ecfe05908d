"""Real checkpoints for the hostile-checkpoint corpus (run as a script, not collected by pytest).

    python ckpt_template_worker.py single DIR                          # one process
    gpukit run --cpu --nproc 2 ckpt_template_worker.py ddp|fsdp DIR    # two gloo processes

Trains a small model two steps under the given strategy and saves a checkpoint after each,
so DIR holds ``step_00000001`` and ``step_00000002`` (a damaged newest step can fall back).
``RESUME_SNIPPET`` resumes such a directory in one process, as a user's script would.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import gpukit


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


RESUME_SNIPPET = """
import sys
sys.path.insert(0, {here!r})
import gpukit
from ckpt_template_worker import build
session = gpukit.Session(accelerator="cpu", verbose=False)
model, optimizer = session.setup(*build())
print("RESUMED", session.resume({directory!r}, model=model, optimizer=optimizer))
"""


def main(kind: str, directory: str) -> None:
    session = gpukit.Session(strategy=kind, accelerator="cpu", verbose=False)
    model, optimizer = session.setup(*build())
    for step in (1, 2):
        x = session.to_device(torch.randn(4, 4, generator=torch.Generator().manual_seed(step)))
        session.backward(model(x).pow(2).sum())
        session.step(optimizer)
        session.save_checkpoint(directory, step, model=model, optimizer=optimizer)
    session.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
