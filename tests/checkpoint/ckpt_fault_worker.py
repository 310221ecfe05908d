"""Save-loop worker for the SIGKILL fault test (run as a script, not collected by pytest).

    python ckpt_fault_worker.py DIR [background]

Resumes from the latest complete checkpoint in DIR/managed (checking it), then saves forever:
each step writes DIR/single.pt with gpukit.save and a CheckpointManager checkpoint, and prints
"SAVED <step> <number of temporary/partial entries left>" once both are complete.

With ``background`` both saves are background saves: a call returns once the state is copied,
and the model is changed for the next step while the files are written. A save returns after
the one before it completed, so once step k's manager save returns, step k-1 is complete and
is reported then (one partial step directory may exist: step k's, being written). Background
mode also makes the manager reuse every retired file (``MIN_REUSE_BYTES = 1``: its files here are
a few KiB), so a kill can land while a save overwrites an adopted file in place; plain mode
writes new files (below the threshold), as it always did.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import torch
from torch import nn

import gpukit
from gpukit.checkpoint import CheckpointManager, _reuse


def main(directory: Path, background: bool) -> None:
    if background:
        _reuse.MIN_REUSE_BYTES = 1
    managed = directory / "managed"
    managed.mkdir(parents=True, exist_ok=True)  # a background save makes it in its thread
    manager = CheckpointManager(managed, keep_last=2)
    model = nn.Linear(16, 16)
    start = manager.resume(model=model) or 0
    assert all(bool((p == start).all()) for p in model.parameters()) or start == 0, "resumed wrong weights"
    single = directory / "single.pt"
    single_step = int(gpukit.load(single)["step"]) if single.exists() else 0
    print(f"RESUMED {start} SINGLE {single_step}", flush=True)
    for step in itertools.count(start + 1):
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(step)
        gpukit.save({"step": step, "w": torch.full((4096,), float(step))}, single, background=background)
        manager.save(step, model=model, extra={"step": step}, background=background)
        leftovers = [n for n in os.listdir(managed) if n.startswith(".") and n != _reuse.REUSE_DIR]
        leftovers += [n for n in os.listdir(directory) if n.startswith(".")]
        if not background:
            print(f"SAVED {step} {len(leftovers)}", flush=True)
        elif step > start + 1:  # step - 1 is complete; step's own staging directory may be there
            print(f"SAVED {step - 1} {max(0, len(leftovers) - 1)}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] == ["background"])
