"""Issue 28's items with 2 real processes (`gpukit run --cpu --nproc 2`, gloo): one launch, DDP then FSDP.

Each number is compared with one process in plain torch doing the same work on the union of the
two ranks' batches (DDP averages gradients over ranks, so that is the same step), or with the
dataset itself.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import _two_rank_worker as worker  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    out = tmp_path_factory.mktemp("two28")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "gpukit", "run", "--cpu", "--nproc", "2", worker.__file__, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (out / "stderr.txt").write_text(proc.stderr)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)], out


@pytest.fixture(scope="module")
def ddp(launched: tuple[list[dict], Path]) -> tuple[list[dict], Path]:
    return [rec["ddp"] for rec in launched[0]], launched[1]


@pytest.fixture(scope="module")
def fsdp(launched: tuple[list[dict], Path]) -> list[dict]:
    return [rec["fsdp"] for rec in launched[0]]


def _reference_training(records: list[dict]) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """Plain torch, one process, the union batch of each micro-step: windows of 4, 4, 2 (each loss
    divided by its window's size), clipping, StepLR stepped after each optimizer step."""
    data = worker.train_data()
    torch.manual_seed(0)
    model = worker.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    windows, norms = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]], []
    for window in windows:
        for i in window:
            x, y, _ = data[torch.tensor(records[0]["indices"][i] + records[1]["indices"][i])]
            (nn.functional.mse_loss(model(x), y) / len(window)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), worker.CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return norms, model.state_dict(), optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_grad_norm_windows_and_schedule_equal_plain_torch(strategy: str, request: pytest.FixtureRequest) -> None:
    records = request.getfixturevalue(strategy)
    records = records[0] if strategy == "ddp" else records
    norms, params, lr = _reference_training(records)
    for rec in records:
        assert rec["stepped"] == [False, False, False, True] * 2 + [False, True]  # 3 steps for 10 batches
        assert rec["norms"] == pytest.approx(norms, rel=1e-5)  # the global norm, not one shard's
        assert all(n > worker.CLIP for n in norms)
        assert rec["lr"] == pytest.approx(lr)  # one scheduler step per optimizer step (0.1 * 0.5**3)
        for key, value in params.items():
            torch.testing.assert_close(rec["params"][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_gather_for_metrics_gives_exactly_the_dataset(strategy: str, request: pytest.FixtureRequest) -> None:
    records = request.getfixturevalue(strategy)
    records = records[0] if strategy == "ddp" else records
    every = list(range(worker.N_EVAL))
    for rec in records:
        for batch_size, (values, words) in [*rec["gathered"].items(), *rec["mixed"].items()]:
            assert values == every, batch_size  # 11, not 12: the repeat of the padding dropped
            assert words == [f"s{i}" for i in every], batch_size
        order = torch.randperm(worker.N_EVAL, generator=torch.Generator().manual_seed(rec["shuffle_seed"]))
        assert rec["shuffled"] == order.tolist()  # the epoch's order, each sample once
        assert rec["dropped"] == every[:10]  # even_batches="drop": the last one left out
        assert rec["uneven_sizes"] == every  # even_batches=False: rank 1's last batch is shorter


def test_what_cannot_be_gathered_is_an_error_on_every_rank(ddp: tuple[list[dict], Path]) -> None:
    for rec in ddp[0]:
        assert "rank 0: shape [2]" in rec["all_gather_error"] and "rank 1: shape [3]" in rec["all_gather_error"]
        assert rec["all_gather_ok"] == [[0], [1]]  # no abort: the group goes on working
        assert "pad_index=" in rec["rows_error"]
        assert rec["rows_padded"] == [[0, 0, 0, -1]] * 2 + [[1, 1, 1, 1]] * 2


def test_uneven_batch_counts_are_refused_then_trained_under_join(ddp: tuple[list[dict], Path]) -> None:
    records = ddp[0]
    for rec in records:
        assert "rank 0: 6, rank 1: 5" in rec["uneven_refused"] and "session.join(model)" in rec["uneven_refused"]
    assert [len(rec["join_indices"]) for rec in records] == [6, 5]
    # plain torch: each step's gradient is the sum of the ranks that still have a batch, over 2 (DDP's
    # average; a rank that finished adds zeros under torch's Join)
    data = worker.train_data()
    torch.manual_seed(0)
    model = worker.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        for rec in records:
            if step < len(rec["join_indices"]):
                x, y, _ = data[torch.tensor(rec["join_indices"][step])]
                (nn.functional.mse_loss(model(x), y) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    for rec in records:
        for key, value in model.state_dict().items():
            torch.testing.assert_close(rec["join_params"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_join_under_fsdp_says_what_to_use_instead(fsdp: list[dict]) -> None:
    for rec in fsdp:
        assert "DDP only" in rec["join_error"] and "even_batches='pad'" in rec["join_error"]


def test_main_process_first_runs_rank0_first_and_passes_its_error_on(ddp: tuple[list[dict], Path]) -> None:
    rank0, rank1 = ddp[0]
    assert rank0["saw_marker_in_block"] and rank1["saw_marker_in_block"]  # rank 1 ran after rank 0's block
    assert rank0["first_error"] == "ValueError: download failed"
    assert "failed on rank 0 (ValueError: download failed)" in rank1["first_error"]


def test_global_batch_per_rank_seeds_and_rank0_trackers(ddp: tuple[list[dict], Path]) -> None:
    (rank0, rank1), out = ddp
    assert rank0["accumulate"] == rank1["accumulate"] == 4  # 16 / (2 per micro-batch x 2 ranks)
    assert torch.equal(rank0["init_weight"], rank1["init_weight"])  # seeded alike until setup
    assert rank0["randint_after_setup"] != rank1["randint_after_setup"]  # seed + rank after setup
    # same seed, no seed_per_rank, batches from torch.randn: warned on every rank
    assert len(rank0["same_stream_warnings"]) == len(rank1["same_stream_warnings"]) == 1
    assert "seed_per_rank=True" in rank0["same_stream_warnings"][0]
    rows = list(csv.DictReader((out / "csv" / "metrics.csv").open()))  # written by rank 0 alone
    assert [float(r["loss"]) for r in rows] == pytest.approx(rank0["tracked_losses"])
    assert rank0["tracked_losses"] != rank1["tracked_losses"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_meta_model_is_materialised_alike_on_both_ranks(strategy: str, request: pytest.FixtureRequest) -> None:
    records = request.getfixturevalue(strategy)
    records = records[0] if strategy == "ddp" else records
    for key, value in records[0]["meta_params"].items():
        assert torch.isfinite(value).all() and value.abs().sum() > 0, key
        assert torch.equal(value, records[1]["meta_params"][key]), key
    assert all(rec["meta_stepped"] for rec in records)


def test_a_finished_two_process_run_ends_without_a_deprecation_warning(ddp: tuple[list[dict], Path]) -> None:
    # the worker's exit scan of open files touched torch.distributed.reduce_op: one FutureWarning per rank
    stderr = (ddp[1] / "stderr.txt").read_text()
    assert "reduce_op" not in stderr and "FutureWarning" not in stderr, stderr[-2000:]


def test_a_warning_every_rank_gives_is_printed_once(ddp: tuple[list[dict], Path]) -> None:
    stderr = (ddp[1] / "stderr.txt").read_text()
    assert stderr.count("UserWarning: gpukit-test: the same on every rank") == 1  # was once per rank
    assert stderr.count("UserWarning: gpukit-test: rank 0 only") == 1
    assert stderr.count("UserWarning: gpukit-test: rank 1 only") == 1
