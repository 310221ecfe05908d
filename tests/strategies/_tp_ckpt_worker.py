"""Worker for the checkpoint chain of test_tensor_parallel_multiprocess.py (`gpukit run --cpu --nproc N`, gloo).

argv: <out dir> <layout: "dp4" (DDP over the 4 processes) or "tp2" (one tensor group of 2)> <checkpoint to resume>.
Builds the small transformer of ``_tp_worker`` (SGD with momentum), resumes the checkpoint into it under this
layout, records the full parameters and momentum buffers, and saves a checkpoint of its own to
<out>/<layout>. Under "tp2" that checkpoint is resumed again into a fresh model under the same layout (what
must come back bit for bit). Writes <out>/<layout>-rank<R>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import gpukit
from _tp_worker import full, make_model


def _state(session: gpukit.Session, source: Path) -> tuple[int, dict, dict, torch.nn.Module, torch.optim.Optimizer]:
    model = make_model("block")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = session.setup(model, optimizer)
    step = session.resume(source, model=model, optimizer=optimizer)
    named = dict(gpukit.unwrap_model(model).named_parameters())
    params = {n: full(p) for n, p in named.items()}
    momentum = {n: full(optimizer.state[p]["momentum_buffer"]) for n, p in named.items() if p in optimizer.state}
    return step, params, momentum, model, optimizer


def main(out_dir: Path, layout: str, source: Path) -> None:
    options = {"strategy": "ddp"} if layout == "dp4" else {"tensor_parallel": 2}
    session = gpukit.Session(accelerator="cpu", seed=0, verbose=False, **options)
    step, params, momentum, model, optimizer = _state(session, source)
    record = {"step": step, "params": params, "momentum": momentum,
              "layout": (session.strategy.layout.replicas, session.strategy.layout.tensor)}
    session.save_checkpoint(out_dir / layout, step + 1, model=model, optimizer=optimizer)
    if layout == "tp2":  # the same layout again: bit for bit
        again = _state(session, out_dir / layout)
        record["again"] = {"step": again[0], "params": again[1], "momentum": again[2]}
    session.barrier()
    torch.save(record, out_dir / f"{layout}-rank{session.rank}.pt")
    session.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))
