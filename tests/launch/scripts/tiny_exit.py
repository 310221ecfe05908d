"""The shortest distributed run: a Session, one all-reduce, and the interpreter's own exit.

Leaves the process group to gpukit's exit hook (no session.close()), where torch's gloo
teardown used to abort some finished runs. ``TINY_EXIT_UNFIXED=1`` disables that hook, to
measure what it fixes (bench/faults.py).
"""

import os

import torch

import gpukit

if os.environ.get("TINY_EXIT_UNFIXED") == "1":
    import gpukit.strategies.ddp as ddp

    ddp.leave_at_exit = lambda strategy: None
session = gpukit.Session(accelerator="cpu", verbose=False)
session.all_reduce(torch.ones(1))
