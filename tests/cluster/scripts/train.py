"""The SLURM tests' job: DDP with a Session, resumable, stopping cleanly when asked.

    python train.py OUT [--ckpt DIR] [--hold-at STEP] [--hold-start] [--step-s SECONDS] [--save-every N]

Trains a small regression model for a fixed number of steps over a fixed global batch
(split over however many processes run it), and rank 0 writes ``OUT/result.json`` with the
final weights. ``--hold-at STEP`` (first attempt of the job only): after STEP, write
``OUT/held`` and wait until the Session says stop -- the test then signals the job, so the
signal always arrives at a known step. ``--hold-start`` (first attempt only): before the Session
exists, write ``OUT/starting-RANK`` and wait -- a worker still starting when the stop comes.
``--step-s``: each step takes at least this long (bench/preemption.py: stops land mid-training).
``--save-every N``: a checkpoint every N steps, ``OUT/saving-RANK-STEP`` written as it begins.
``OUT/begin-RANK-ATTEMPT`` is written first thing, before torch is imported (the trial harness
tells a worker that starts from one still importing by it).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

RANK = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))  # gpukit run, or an srun task
ATTEMPT = os.environ.get("SLURM_RESTART_COUNT", "0")
(Path(sys.argv[1]) / f"begin-{RANK}-{ATTEMPT}").write_text(str(os.getpid()))

import torch  # noqa: E402 - after the marker: importing takes seconds
from torch import nn  # noqa: E402

import gpukit  # noqa: E402
from gpukit.cluster import environment  # noqa: E402

STEPS = 6
GLOBAL_BATCH = 8
HOLD_TIMEOUT_S = 120

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--ckpt")
parser.add_argument("--hold-at", type=int)
parser.add_argument("--hold-start", action="store_true")
parser.add_argument("--step-s", type=float, default=0.0)
parser.add_argument("--save-every", type=int, default=0)
args = parser.parse_args()
out = Path(args.out)
if args.hold_start and ATTEMPT == "0":
    (out / f"starting-{RANK}").write_text(str(os.getpid()))
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    while time.monotonic() < deadline:  # the stop ends this process: there is nothing to save yet
        time.sleep(0.05)
    sys.exit(f"no stop within {HOLD_TIMEOUT_S} s")

session = gpukit.Session(accelerator="cpu", seed=0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
model, optimizer = session.setup(model, optimizer)
generator = torch.Generator().manual_seed(1)
x = torch.randn(GLOBAL_BATCH * STEPS, 8, generator=generator)
data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
loader = session.setup_dataloader(data, batch_size=GLOBAL_BATCH // session.world_size, shuffle=False)

step = (session.resume(args.ckpt, model=model, optimizer=optimizer, loader=loader) or 0) if args.ckpt else 0
cluster = environment()
(out / f"rank-{session.rank}-attempt-{cluster.restart_count}").write_text(
    json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "start_step": step, "kind": cluster.kind})
)
for xb, yb in loader:
    loss = nn.functional.mse_loss(model(xb), yb)
    session.backward(loss)
    session.step(optimizer)
    step += 1
    time.sleep(args.step_s)  # a longer step, as real training has (0: none)
    if args.hold_at == step and cluster.restart_count == 0:
        if session.is_main:
            (out / "held").write_text(str(step))
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        while not session.should_stop:  # every rank polls together (one all-reduce each)
            if time.monotonic() > deadline:
                sys.exit(f"no stop request within {HOLD_TIMEOUT_S} s")
            time.sleep(0.05)
    stop = session.should_stop
    if stop or (args.save_every and step % args.save_every == 0):
        (out / f"saving-{session.rank}-{step}").write_text(str(time.time()))
        session.save_checkpoint(args.ckpt, step, model=model, optimizer=optimizer, loader=loader)
    if stop:
        (out / f"stopped-rank-{session.rank}").write_text(str(step))
        sys.exit(0)

if session.is_main:
    params = [p.detach().flatten().tolist() for p in gpukit.unwrap_model(model).parameters()]
    (out / "result.json").write_text(json.dumps({"world": session.world_size, "steps": step, "params": params}))
