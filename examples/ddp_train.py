"""A DistributedDataParallel training script, rewritten with gpukit.

No ``init_process_group``, ``LOCAL_RANK`` parsing, ``DistributedSampler``/``set_epoch``,
``torch.cuda.set_device`` or "only rank 0 prints" boilerplate. Start it any of these ways:

    torchrun --nproc-per-node 2 examples/ddp_train.py      # one process per GPU (or CPU)
    gpukit run --gpus 2 examples/ddp_train.py
    python examples/ddp_train.py --processes 2             # session.launch starts them
    python examples/ddp_train.py                           # one process (DDP of one)

On a machine without GPUs every process trains on the CPU over gloo.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import gpukit


def make_data(n: int = 1024) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 20, generator=g)
    y = (x[:, :5].sum(1) > 0).long()  # a learnable rule
    return TensorDataset(x, y)


def train(session: gpukit.Session, epochs: int) -> float:
    model = nn.Sequential(nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = session.setup(model, optimizer)
    # batch_size is per process; each rank gets its own shard, reshuffled every epoch
    loader = session.setup_dataloader(make_data(), batch_size=32, shuffle=True)
    for epoch in range(epochs):
        total = torch.zeros((), device=session.device)
        for x, y in loader:
            with session.accumulate(model):  # no gradient sync until the step's last micro-batch
                with session.autocast():
                    loss = F.cross_entropy(model(x), y)
                session.backward(loss)
            session.step(optimizer, clip_grad_norm=1.0)
            total += loss.detach()
        mean_loss = session.all_reduce(total / len(loader), op="mean").item()
        ranks = "1 rank" if session.world_size == 1 else f"{session.world_size} ranks"
        session.print(f"epoch {epoch}: loss {mean_loss:.4f} (mean over {ranks})")
    return mean_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--processes", type=int, default=None,
                        help="start this many processes from here (session.launch)")
    args = parser.parse_args()
    devices = args.processes if args.processes else "auto"
    accelerator = "auto" if torch.cuda.is_available() else "cpu"
    session = gpukit.Session(devices=devices, accelerator=accelerator, strategy="ddp", seed=0,
                             accumulate_grad_batches=2, sync_batchnorm=True)
    losses = session.launch(train, args.epochs)
    if session.is_main:
        print(f"final loss per rank: {[round(v, 4) for v in losses]}")


if __name__ == "__main__":
    main()
