"""Loader tuning you can trust: incomplete searches said and not cached, ties to the simpler
setting, where the cache is and how to re-tune, and an epoch that contradicts the cache."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

import gpukit
from gpukit.data import LoaderSettings, Trial, tune_loader
from gpukit.data._tune import _confirmed
from gpukit.data._tune_cache import _cache_key, _write_cache
from gpukit.data._workers import usable_cpu_count


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GPUKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("GPUKIT_RETUNE", raising=False)
    return tmp_path / "cache"


class Sleepy(Dataset):
    """``delay_s`` of waiting per item (I/O-like: workers overlap it even on a busy machine)."""

    def __init__(self, n: int = 64, delay_s: float = 0.01) -> None:
        self.n, self.delay_s = n, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.delay_s)
        return torch.tensor([float(i)])


def _cached(cache: Path) -> dict:
    path = cache / "loader_tuning.json"
    return json.loads(path.read_text()) if path.exists() else {}


def test_a_search_cut_by_its_budget_says_so_and_is_not_cached(
    _own_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 0.2 s per batch: the first candidate alone needs more than the whole 0.3 s budget
    result = tune_loader(Sleepy(delay_s=0.05), 4, time_budget_s=0.3, max_workers=4)
    assert not result.complete
    assert len(result.trials) < 4  # 0, 1, 2, 4 workers were wanted
    out = capsys.readouterr().out
    assert "incomplete" in out and "not cached" in out and "GPUKIT_TUNE_BUDGET_S=" in out
    assert _cached(_own_cache) == {}
    again = tune_loader(Sleepy(delay_s=0.05), 4, time_budget_s=0.3, max_workers=4, verbose=False)
    assert not again.from_cache  # measured again, not the incomplete guess
    # each trial is bounded: two timed batches past twice its slice, not six
    assert result.elapsed_s < 4.0, result.report()


def test_a_tie_keeps_the_simpler_setting() -> None:
    zero, two = LoaderSettings(0), LoaderSettings(2)

    def trial(settings: LoaderSettings, rate: float) -> Trial:
        return Trial(settings, rate, 0.0, 10)

    # the case from the field: 2 workers first measured faster, then 4.6 batches/s for both
    assert _confirmed(trial(zero, 4.4), trial(two, 5.0), trial(zero, 4.6), trial(two, 4.6)).settings == zero
    # a win inside the noise of the repeated measurements is no win
    assert _confirmed(trial(zero, 4.0), trial(two, 5.0), trial(zero, 5.0), trial(two, 5.2)).settings == zero
    # a clear, repeated win is
    assert _confirmed(trial(zero, 4.0), trial(two, 9.0), trial(zero, 4.1), trial(two, 8.8)).settings == two


def test_the_report_says_where_the_cache_is_and_retune_measures_again(
    _own_cache: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # what a complete earlier tuning left (the key tune_loader looks up for these arguments)
    _write_cache(_cache_key(Sleepy(), 4, None, None, 1, 1), LoaderSettings(1, persistent_workers=True), 50.0)
    second = tune_loader(Sleepy(), 4, time_budget_s=0.8, max_workers=1)
    out = capsys.readouterr().out
    assert second.from_cache and str(_own_cache / "loader_tuning.json") in out and "GPUKIT_RETUNE=1" in out
    monkeypatch.setenv("GPUKIT_RETUNE", "1")
    third = tune_loader(Sleepy(), 4, time_budget_s=0.8, max_workers=1, verbose=False)
    assert not third.from_cache and third.trials


@pytest.mark.skipif(usable_cpu_count() < 2, reason="needs a spare CPU for a loader worker")
def test_an_epoch_that_contradicts_the_cache_drops_it_and_never_advises_tune(
    _own_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = Sleepy(n=32, delay_s=0.002)
    # a cache entry as an earlier run's tuning leaves it, claiming a loader far faster than
    # this one (as if tuned in an idle moment): the key is the one setup_dataloader looks up
    key = _cache_key(data, 4, None, torch.device("cpu"), 1, usable_cpu_count())
    _write_cache(key, LoaderSettings(0), 1e6)
    session = gpukit.Session(devices="cpu", verbose=False)
    loader = session.setup_dataloader(data, batch_size=4, num_workers="tune")
    assert loader.tuned is not None and loader.tuned.from_cache and loader.num_workers == 0
    for _ in loader:
        time.sleep(0.001)  # a step much shorter than the wait for data
    report = session.timings.epoch_reports[-1]
    assert report.causes[0] == "retune" and set(report.causes) <= {"retune", "threads"}, report.line
    assert 'try num_workers="tune"' not in report.line
    assert "loader_tuning.json" in report.line and "GPUKIT_RETUNE=1" in report.line
    assert _cached(_own_cache) == {}  # the next run measures again
