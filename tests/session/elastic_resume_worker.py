"""One rank of the N -> M resume tests (run by ``gpukit run --cpu --nproc W``; not collected by pytest).

    python elastic_resume_worker.py OUT TAG STRATEGY ACCUMULATE [--resume CKPT] [--save CKPT:STEP]
        [--seed-per-rank] [--micro-batch B]

Trains EPOCHS epochs (from CKPT's latest checkpoint with --resume), saving a checkpoint of STEP into
CKPT with --save. The script is the same at every world size, as a requeued job's is:
``Session(accumulate_grad_batches=A)`` with the ``A`` the first launch chose for its size. A resume on
another number of ranks must change the accumulation itself to keep the global batch (GLOBAL_BATCH
samples a step), cut the rest of the epoch over the new ranks and carry the optimizer's step count,
moments and the LR schedule.

Each rank writes ``OUT/TAG-RANK.json``: the ids of the samples of every optimizer step it ran (all
real: 96 samples divide by every size), the accumulation in force, a draw from torch's generator
right after the save and right after the resume; rank 0 writes ``OUT/TAG.pt``: the final weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

import gpukit

SAMPLES, MICRO_BATCH, GLOBAL_BATCH, EPOCHS, SAVE_AT = 96, 2, 24, 2, 6  # 4 steps an epoch: step 6 is mid-epoch 1


class Ids(torch.utils.data.Dataset):
    """Sample ``i``: fixed features, a target, and its id."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(3)
        self.x = torch.randn(SAMPLES, 5, generator=generator)
        self.y = self.x @ torch.randn(5, 1, generator=generator) + 0.1 * torch.randn(SAMPLES, 1, generator=generator)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    session = gpukit.Session(accelerator="cpu", strategy=args.strategy, seed=0, verbose=args.resume is not None,
                             accumulate_grad_batches=args.accumulate, seed_per_rank=args.seed_per_rank)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    model, optimizer = session.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    loader = session.setup_dataloader(Ids(), batch_size=args.micro_batch, shuffle=True, num_workers=1,
                                      persistent_workers=False)
    objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader}
    step, report = 0, {"world": session.world_size}
    if args.resume is not None:
        step = report["resumed_at"] = session.resume(args.resume, **objects)
        report["resume_probe"] = torch.rand(1).item()
    save_dir, save_at = (args.save.split(":") + [""])[:2] if args.save else (None, "-1")
    steps: dict[int, list[int]] = {}
    window: list[int] = []
    while loader.epoch < EPOCHS:
        for xb, yb, ids in loader:
            window += [int(i) for i in ids]
            session.backward(nn.functional.mse_loss(model(xb), yb))
            if session.step(optimizer):
                scheduler.step()
                step += 1
                steps[step], window = window, []
                if step == int(save_at):
                    session.save_checkpoint(save_dir, step, **objects)
                    report["save_probe"] = torch.rand(1).item()
    report.update(accumulate=session.accumulate_grad_batches, steps=steps, lr=scheduler.get_last_lr()[0])
    (args.out / f"{args.tag}-{session.rank}.json").write_text(json.dumps(report))
    if args.strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    else:
        weights = {k: v.detach().clone() for k, v in gpukit.unwrap_model(model).state_dict().items()}
    if session.rank == 0:
        torch.save({"weights": weights, "moments": _moments(optimizer, args.strategy)}, args.out / f"{args.tag}.pt")
    session.close()


def _moments(optimizer: torch.optim.Optimizer, strategy: str) -> list[torch.Tensor]:
    """Adam's step counts and first moments (FSDP's are sharded: compared through the weights)."""
    if strategy == "fsdp":
        return []
    return [state[key].detach().clone() for state in optimizer.state.values() for key in ("step", "exp_avg")]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("tag")
    parser.add_argument("strategy")
    parser.add_argument("accumulate", type=int)
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--save")
    parser.add_argument("--seed-per-rank", action="store_true")
    # 1 lets 8 ranks keep GLOBAL_BATCH (24 = 1 x 3 x 8; with 2, 24 samples do not split over 8 ranks)
    parser.add_argument("--micro-batch", type=int, default=MICRO_BATCH)
    main(parser.parse_args())
