"""Loader tuning: measured choices, the report, the cache, and one choice for all DDP ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

import gpukit
from gpukit.data import LoaderSettings, tune_loader
from gpukit.errors import ConfigurationError

BUDGET_S = 1.5


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GPUKIT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


class SleepyItems(Dataset):
    """Waits on I/O (a sleep) per item: workers overlap it even on a busy machine."""

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.01)
        return torch.tensor([float(i)])


def test_in_memory_tensor_dataset_tunes_to_no_workers(capsys: pytest.CaptureFixture[str]) -> None:
    # small batches of large items: in the process, a few index ops; through a worker, each
    # batch is copied into shared memory and handed over (a margin a busy machine cannot erase)
    result = tune_loader(TensorDataset(torch.randn(2048, 8192)), 8, time_budget_s=BUDGET_S)
    assert result.settings == LoaderSettings(0)
    tried = [t.settings.num_workers for t in result.trials]
    assert tried[0] == 0 and max(tried) >= 1  # workers were measured, and lost
    zero = result.trials[0].batches_per_s
    assert zero and all((t.batches_per_s or 0) < zero for t in result.trials[1:])
    out = capsys.readouterr().out
    assert "loader tuning" in out and "chose num_workers=0" in out and "num_workers=1" in out
    assert result.elapsed_s < BUDGET_S + 10  # bounded (start-ups of one late trial on top)


def test_slow_items_tune_to_persistent_workers_and_the_cache_remembers(
    capsys: pytest.CaptureFixture[str], _own_cache: Path
) -> None:
    first = tune_loader(SleepyItems(), 4, step_fn=lambda batch: time.sleep(0.02),
                        time_budget_s=BUDGET_S, max_workers=2)
    assert first.settings.num_workers >= 1 and first.settings.persistent_workers
    assert not first.from_cache
    assert (_own_cache / "loader_tuning.json").exists()
    capsys.readouterr()
    start = time.perf_counter()
    again = tune_loader(SleepyItems(), 4, step_fn=lambda batch: time.sleep(0.02),
                        time_budget_s=BUDGET_S, max_workers=2)
    assert again.from_cache and again.settings == first.settings and again.trials == ()
    assert time.perf_counter() - start < 1.0
    assert "tuning cache" in capsys.readouterr().out
    other = tune_loader(SleepyItems(), 8, time_budget_s=0.3, max_workers=1, verbose=False)
    assert not other.from_cache  # another batch size is another key


def test_setup_dataloader_tune_applies_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUKIT_TUNE_BUDGET_S", str(BUDGET_S))
    s = gpukit.Session(devices="cpu", verbose=False)
    loader = s.setup_dataloader(TensorDataset(torch.randn(1024, 8192)), batch_size=8, num_workers="tune")
    assert loader.num_workers == 0
    assert sum(len(b[0]) for b in loader) == 1024


def test_bad_input_is_refused() -> None:
    class Stream(IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from range(3)

    with pytest.raises(ConfigurationError, match="map-style"):
        tune_loader(Stream(), 4)
    with pytest.raises(ConfigurationError, match="batch_size=0"):
        tune_loader(TensorDataset(torch.zeros(4)), 0)
    with pytest.raises(ConfigurationError, match="time_budget_s=-1"):
        tune_loader(TensorDataset(torch.zeros(4)), 2, time_budget_s=-1)
    s = gpukit.Session(devices="cpu", verbose=False)
    with pytest.raises(ConfigurationError, match="'auto', 'tune'"):
        s.setup_dataloader(TensorDataset(torch.zeros(4)), num_workers="fast")


@pytest.mark.slow
def test_ddp_ranks_end_with_rank_zero_s_settings_and_one_epoch_report(tmp_path: Path) -> None:
    worker = Path(__file__).parent / "_ddp_loader_worker.py"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(GPUKIT_TUNE_BUDGET_S="1.0", GPUKIT_CACHE_DIR=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(worker), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert records[1]["alone"] >= 1  # rank 1 alone would have chosen workers...
    assert records[0]["tuned"] == records[1]["tuned"] == [0, False]  # ...all take rank 0's
    # the epoch report is gathered on rank 0 (which prints it); rank 1 keeps its own figures
    assert records[0]["ranks"] == 2 and records[0]["worst"] == 1
    assert records[0]["shares"][1] > 0.8
    assert records[1]["ranks"] == 1 and records[1]["shares"][0] > 0.8
    assert "rank 1 worst" in records[0]["line"]
    # rank 0's pass alone over a sharded loader ended after the report's short wait, not a hang
    assert records[0]["alone_pass_s"] < 30, records[0]
    assert any("covers rank 0 only" in w and "rank(s) 1" in w for w in records[0]["alone_warnings"])
