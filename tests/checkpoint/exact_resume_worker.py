"""One rank of the exact-resume-at-scale test (run by ``gpukit run --cpu --nproc N``; not collected).

    python exact_resume_worker.py OUT STRATEGY[,STRATEGY] [--resume-only]

For each strategy (ddp, fsdp), in this process: train STEPS steps uninterrupted with a Session,
checkpointing mid-epoch at SAVE_AT (run A); then set up a new model, optimizer and loader -- new
DDP buckets, new FSDP shards, new loader workers, as a restarted job has -- resume that checkpoint
and train to STEPS (run B). ``--resume-only``: only run B, from the checkpoint and final state a
run A left in OUT (fresh processes). Each rank writes ``OUT/STRATEGY-RANK.json``: how many of its
values (parameters and optimizer state, its own shard under FSDP) differ between A and B.

The step uses every source of randomness a real loop has: a shuffling loader with two workers
whose samples draw noise (torch in the workers, seeded per batch), dropout (torch in the main
process) and Adam's state.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

import gpukit

STEPS, SAVE_AT, PER_RANK_BATCH, BATCHES_PER_EPOCH = 5, 3, 2, 2


class NoisyData(torch.utils.data.Dataset):
    """A regression set whose samples get fresh noise each time (drawn in the loader workers)."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(7)
        self.x = torch.randn(size, 8, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True).sin()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index] + 0.01 * torch.randn(8), self.y[index]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # FSDP: this rank's shard


def _values(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    inner = gpukit.unwrap_model(model)
    out = [_local(p).detach().clone() for p in inner.parameters()]
    for p in inner.parameters():
        out += [_local(v).detach().clone() for v in optimizer.state[p].values() if torch.is_tensor(v)]
    return out


def _train(session: gpukit.Session, ckpt: Path, resume: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)  # the same initial weights on every rank and in both runs
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = session.setup(model, optimizer)
    data = NoisyData(PER_RANK_BATCH * BATCHES_PER_EPOCH * session.world_size)
    loader = session.setup_dataloader(data, batch_size=PER_RANK_BATCH, shuffle=True, num_workers=2,
                                      persistent_workers=False)
    step = session.resume(ckpt, model=model, optimizer=optimizer, loader=loader) if resume else 0
    assert step == (SAVE_AT if resume else 0), step
    while step < STEPS:
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            session.backward(loss)
            session.step(optimizer)
            step += 1
            if step == SAVE_AT and not resume:
                session.save_checkpoint(ckpt, step, model=model, optimizer=optimizer, loader=loader)
            if step == STEPS:
                break
    return _values(model, optimizer)


def main(out: Path, strategies: list[str], resume_only: bool) -> None:
    for strategy in strategies:
        session = gpukit.Session(accelerator="cpu", strategy=strategy, seed=0, verbose=False)
        ckpt = out / f"ckpt-{strategy}"
        final_a = out / f"{strategy}-final-{session.rank}.pt"
        if resume_only:
            a = torch.load(final_a)
        else:
            a = _train(session, ckpt, resume=False)
            torch.save(a, final_a)
        b = _train(session, ckpt, resume=True)
        differ = [int((x != y).sum()) for x, y in zip(a, b)]
        worst = max(float((x - y).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b))
        report = {"world": session.world_size, "values": sum(x.numel() for x in a), "differ": sum(differ),
                  "max_abs": worst, "tensors": len(a)}
        (out / f"{strategy}-{session.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2].split(","), "--resume-only" in sys.argv[3:])
