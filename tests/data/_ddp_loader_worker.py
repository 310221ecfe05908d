"""Worker for test_tune.py's DDP check, started by torchrun with 2 processes (gloo, CPU).

Rank 1's items are slow (it alone would tune to workers); rank 0's are free (0 workers).
Each rank records the settings ``num_workers="tune"`` gave it, what it would have chosen
alone, and the end-of-epoch report. Writes <out>/rank<R>.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

import torch
from torch.utils.data import Dataset

import gpukit
from gpukit.data import tune_loader


class RankSkewed(Dataset):
    def __init__(self, slow: bool) -> None:
        self.slow = slow

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.slow:
            time.sleep(0.01)
        return torch.tensor([float(i)])


def main(out: str) -> None:
    session = gpukit.Session(verbose=False)
    rank = session.rank
    data = RankSkewed(slow=rank == 1)
    alone = tune_loader(data, 4, step_fn=lambda b: time.sleep(0.03), cache=False, verbose=False,
                        local_world_size=2)
    loader = session.setup_dataloader(data, batch_size=4, num_workers="tune")
    for _ in loader:
        pass
    report = session.timings.epoch_reports[-1]
    # a sharded loader iterated on rank 0 alone (an evaluation on the main rank) must not hang
    # in the end-of-epoch report: rank 0 waits a few seconds for rank 1, then reports alone
    val = session.setup_dataloader(RankSkewed(slow=False), batch_size=4, num_workers=0)
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if rank == 0:
            for _ in val:
                pass
    alone_s = time.monotonic() - started
    session.barrier()
    record = {
        "alone_pass_s": alone_s, "alone_warnings": [str(w.message) for w in caught],
        "rank": rank, "tuned": [loader.num_workers, loader.persistent_workers],
        "alone": alone.settings.num_workers, "line": report.line, "worst": report.worst_rank,
        "ranks": len(report.ranks), "shares": [r.data_share for r in report.ranks],
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    session.close()


if __name__ == "__main__":
    main(sys.argv[1])
