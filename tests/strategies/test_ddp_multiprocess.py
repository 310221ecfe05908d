"""DDP with 2 real processes (torchrun, gloo, CPU): one launch, several checks.

The reference is one process training on the full batch: at each micro-step it sees the
union of what the two ranks saw, with an ordinary BatchNorm.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import _ddp_worker as worker  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("ddp")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # --standalone rendezvous binds a free port itself: no fixed port to collide on
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(worker.__file__)), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def test_auto_strategy_is_ddp_on_gloo_with_collectives(records: list[dict]) -> None:
    for rank, rec in enumerate(records):
        assert (rec["strategy"], rec["backend"], rec["world_size"], rec["rank"]) == (
            "ddp", "gloo", 2, rank)
        assert rec["sync_bn_type"] == "HostSyncBatchNorm"
        assert rec["all_reduce"] == {"sum": 1.0, "mean": 0.5, "max": 1.0, "min": 0.0}
        assert rec["broadcast"] == {"from": 0}


def test_ranks_see_disjoint_shards_reshuffled_each_epoch(records: list[dict]) -> None:
    per_epoch = len(records[0]["indices"]) // worker.EPOCHS
    orders = []
    for epoch in range(worker.EPOCHS):
        shards = [
            [i for batch in rec["indices"][epoch * per_epoch:(epoch + 1) * per_epoch] for i in batch]
            for rec in records
        ]
        assert not set(shards[0]) & set(shards[1])
        assert sorted(shards[0] + shards[1]) == list(range(worker.N))
        orders.append(shards[0])
    assert orders[0] != orders[1]  # set_epoch happened without the loop asking


def test_no_sync_until_the_accumulation_boundary(records: list[dict]) -> None:
    # micro-batches 1, 3, 5... are accumulated locally; every 2nd one synchronises
    expected = [(i + 1) % worker.ACCUM == 0 for i in range(len(records[0]["indices"]))]
    assert records[0]["grads_equal_after_micro"] == expected


def test_same_parameters_and_bn_stats_as_one_process_on_the_full_batch(records: list[dict]) -> None:
    data = worker.make_data()
    torch.manual_seed(0)  # what Session(seed=0) did before the worker built its model
    model = worker.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (i0, i1) in enumerate(zip(records[0]["indices"], records[1]["indices"])):
        x, y, _ = data[torch.tensor(i0 + i1)]
        (nn.functional.mse_loss(model(x), y) / worker.ACCUM).backward()
        if (step + 1) % worker.ACCUM == 0:
            optimizer.step()
            optimizer.zero_grad()
    reference = model.state_dict()
    for rec in records:
        for key, value in reference.items():
            torch.testing.assert_close(rec["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert reference["1.running_mean"].abs().sum() > 0  # the statistics were actually updated
