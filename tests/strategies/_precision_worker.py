"""Worker for test_forward_precision.py: train a few steps WITHOUT ``session.autocast()`` and record
the dtype the maths ran in, read inside the model.

Usage: ``_precision_worker.py OUT STRATEGY PRECISION [OPTION,...]`` with options ``meta`` (the model
built on the meta device), ``ac`` (activation checkpointing), ``compile`` (``Session(compile=...)``).
Started directly for single / dp / pipeline and by ``gpukit run --cpu --nproc 2`` for ddp / fsdp.
Writes ``OUT/rank<R>.json``: per Linear call whether autocast was on and its output dtype (forward
and the checkpointed recompute in backward), the model's output dtype, the losses, the returned
model's type and its state-dict keys.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import gpukit
from gpukit.strategies import PipelineStrategy


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(x))


def make_model() -> nn.Sequential:
    # a Sequential: the pipeline splits it; FSDP makes each Block a unit
    return nn.Sequential(nn.Linear(8, 16), Block(), Block(), nn.Linear(16, 1))


def watch(model: nn.Module, seen: list[dict[str, Any]]) -> None:
    """Record, for every Linear call, whether autocast was on and the dtype its output came out in."""
    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        seen.append({"autocast": torch.is_autocast_enabled("cpu"), "dtype": str(output.dtype),
                     "grad_enabled": torch.is_grad_enabled()})

    for sub in model.modules():
        if isinstance(sub, nn.Linear):
            sub.register_forward_hook(hook)


def main(out: Path, strategy_name: str, precision: str, options: set[str]) -> None:
    strategy: Any = strategy_name
    if strategy_name == "pipeline":
        strategy = PipelineStrategy(["cpu", "cpu"], chunks=2, verbose=False)
    session = gpukit.Session(
        accelerator="cpu", strategy=strategy, precision=precision, seed=0, verbose=False,
        activation_checkpointing=(lambda m, name: isinstance(m, Block)) if "ac" in options else None,
        compile={"backend": "aot_eager"} if "compile" in options else None,
    )
    if "meta" in options:
        with torch.device("meta"):
            model = make_model()
    else:
        model = make_model()
    seen: list[dict[str, Any]] = []
    watch(model, seen)
    model_ref = model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = session.setup(model, optimizer)
    g = torch.Generator().manual_seed(session.rank)
    losses, out_dtypes = [], []
    for _ in range(2):
        x, y = (t.to(session.device) for t in (torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)))
        output = model(x)  # no session.autocast(): the set-up model runs at the session's precision
        out_dtypes.append(str(output.dtype))
        loss = nn.functional.mse_loss(output, y)
        session.backward(loss)
        session.step(optimizer)
        losses.append(loss.item())
    record = {
        "seen": seen, "out_dtypes": out_dtypes, "losses": losses, "returned": type(model).__name__,
        "keys": sorted(gpukit.unwrap_model(model).state_dict()), "plain_keys": sorted(make_model().state_dict()),
        "same_object": gpukit.unwrap_model(model) is model_ref,
    }
    (out / f"rank{session.rank}.json").write_text(json.dumps(record))
    session.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3], set(filter(None, (sys.argv[4:] or [""])[0].split(","))))
