"""A 2-process run whose script leaves a file open with unwritten lines (a worker that ends
after its Session made a process group skips the interpreter's teardown: they must still land)."""

import sys

import torch

import gpukit

session = gpukit.Session(accelerator="cpu", verbose=False)
session.all_reduce(torch.ones(1))
log = open(f"{sys.argv[1]}/rank{session.rank}.log", "w")  # noqa: SIM115 - left open on purpose
log.write(f"rank {session.rank} done\n")
