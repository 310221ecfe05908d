"""A worker script for the launcher tests: ``behave.py SCENARIO OUTDIR``.

Readiness and results are files in OUTDIR that the test polls for (never sleeps on).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

scenario, out = sys.argv[1], Path(sys.argv[2])
rank = int(os.environ["RANK"])
attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def mark(name: str, data: object = "") -> None:
    tmp = out / f".{name}.tmp"
    tmp.write_text(json.dumps(data))
    tmp.rename(out / name)  # atomic: the test never reads half a file


def wait_for(name: str) -> None:
    while not (out / name).exists():
        time.sleep(0.05)


def idle_forever() -> None:
    while True:
        time.sleep(0.1)


if scenario == "env":
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    keys = [k for k in os.environ if k.startswith(("GPUKIT_", "CUDA_", "TORCHELASTIC_", "OMP_"))]
    keys += ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
    mark(f"env-{rank}.json", {"env": {k: os.environ.get(k) for k in keys}, "sum": value.item(),
                              "argv": sys.argv, "name": __name__, "cuda": torch.cuda.is_available()})
    dist.barrier()  # gloo can abort if one rank tears down while the other still talks
    dist.destroy_process_group()
elif scenario == "crash":
    mark(f"attempt-{attempt}-rank-{rank}")
    if rank == 1:
        wait_for(f"attempt-{attempt}-rank-0")
        print(1 / 0)
    idle_forever()
elif scenario == "hang":
    import torch
    import torch.distributed as dist

    from gpukit.launch import install_preemption_handler

    install_preemption_handler()  # SIGTERM no longer kills: only SIGKILL will
    dist.init_process_group("gloo")
    mark(f"ready-{rank}")
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins: hangs in the collective
    idle_forever()
elif scenario == "preempt":
    from gpukit.launch import install_preemption_handler, stop_requested

    install_preemption_handler()
    mark(f"ready-{rank}")
    while not stop_requested():
        time.sleep(0.05)
    mark(f"stopped-{rank}")  # a real script would save a checkpoint here
elif scenario == "sleep":
    mark(f"ready-{rank}", {k: v for k, v in os.environ.items() if k.startswith(("CUDA_", "GPUKIT_"))})
    idle_forever()
elif scenario == "ddp":
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(3):
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    if dist.get_rank() == 0:
        mark("ddp.json", {"world": dist.get_world_size(),
                          "params": [p.detach().flatten().tolist() for p in model.parameters()]})
    dist.barrier()
    dist.destroy_process_group()
else:
    raise SystemExit(f"unknown scenario {scenario!r}")
