"""find_batch_size: doubling then log-space bisection, against synthetic memory limits."""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch

from gpukit.errors import ConfigurationError, MemoryPlanError
from gpukit.memory import BatchSizeTrial, find_batch_size


def _limit(threshold: int) -> Callable[[int], None]:
    def step(batch_size: int) -> None:
        if batch_size > threshold:
            raise torch.OutOfMemoryError(f"injected: {batch_size} > {threshold}")

    return step


@pytest.mark.parametrize("start", [1, 8])
def test_within_5_percent_in_at_most_12_trials(start: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # A full collection after each failed trial frees cycles a failed step leaves on a GPU;
    # here it only costs time, so count the calls instead of running them.
    collections: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(1) or 0)
    # every limit up to 127x the start: the documented range of the 12-trial bound
    for threshold in range(start, start * 128, start):
        collections.clear()
        result = find_batch_size(_limit(threshold), start=start, margin=0)
        assert len(result.trials) <= 12, (threshold, result.trials)
        assert threshold * 0.95 <= result.max_fitting_batch_size <= threshold, threshold
        assert result.batch_size == result.max_fitting_batch_size
        assert len(collections) == sum(not t.fits for t in result.trials)


def test_margin_trials_callback_and_bounds() -> None:
    seen: list[BatchSizeTrial] = []
    result = find_batch_size(_limit(100), start=4, margin=0.1, on_trial=seen.append)
    assert list(result.trials) == seen
    assert [t.batch_size for t in seen[:6]] == [4, 8, 16, 32, 64, 128]
    assert [t.fits for t in seen[:6]] == [True] * 5 + [False]
    assert result.smallest_failing_batch_size is not None and result.smallest_failing_batch_size > 95
    assert result.batch_size == int(result.max_fitting_batch_size * 0.9)
    capped = find_batch_size(_limit(1000), start=4, max=50, margin=0)
    assert capped.max_fitting_batch_size == 50 and capped.smallest_failing_batch_size is None
    assert max(t.batch_size for t in capped.trials) == 50


def test_start_that_does_not_fit_and_bad_arguments() -> None:
    with pytest.raises(MemoryPlanError, match="even the start size 8"):
        find_batch_size(_limit(4), start=8)
    for kwargs in ({"start": 0}, {"start": 8, "max": 4}, {"margin": 1.0}, {"tolerance": 0}):
        with pytest.raises(ConfigurationError):
            find_batch_size(_limit(4), **kwargs)
    for trials in (0, -1):  # nothing ran, and the error said even the start size runs out of memory
        with pytest.raises(ConfigurationError, match=r"max_trials=%d\): expected an int >= 1" % trials):
            find_batch_size(_limit(4), max_trials=trials)


def test_errors_other_than_out_of_memory_propagate() -> None:
    def broken(batch_size: int) -> None:
        raise ValueError("shape mismatch")

    with pytest.raises(ValueError, match="shape mismatch"):
        find_batch_size(broken)


@pytest.mark.requires_gpu
def test_real_gpu_limit_is_found() -> None:
    limit_bytes = 256 * 2**20  # a synthetic budget on a real device: allocate, OOM past it

    def step(batch_size: int) -> None:
        if batch_size * 2**20 > limit_bytes:
            raise torch.cuda.OutOfMemoryError("over budget")
        x = torch.empty(batch_size, 2**18, device="cuda")  # 1 MiB per item
        del x

    result = find_batch_size(step, start=8, margin=0, device="cuda")
    assert 0.95 * 256 <= result.max_fitting_batch_size <= 256
    assert all(t.peak_allocated_bytes is not None for t in result.trials if t.fits)


def test_cpu_search_stops_before_the_ram_runs_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU nothing raises out-of-memory: the OS kills the process. The search must bound
    itself by the RAM available (here pretended to be 200 MiB) instead of doubling forever."""
    from gpukit.memory import _host_ram

    class Memory:
        available = 200 * 2**20

    monkeypatch.setattr(_host_ram.psutil, "virtual_memory", lambda: Memory())
    per_sample = 2 * 2**20
    ran: list[int] = []

    def step(batch_size: int) -> None:
        ran.append(batch_size)
        if batch_size * per_sample > 400 * 2**20:  # a regression fails here, not by the OOM killer
            raise AssertionError(f"batch size {batch_size} would take {batch_size * 2} MiB: the RAM bound failed")
        activations = torch.ones(batch_size * per_sample // 4)  # touched: resident
        assert float(activations[::4096].sum()) > 0

    result = find_batch_size(step, start=1, margin=0, device="cpu")
    assert max(ran) * per_sample <= 150 * 2**20 * 1.1  # 75% of 200 MiB, with room for RSS noise
    assert result.trials[-1].ram_limited or any(t.ram_limited for t in result.trials)
    assert 40 <= result.max_fitting_batch_size <= 80, result.trials
    assert all(t.duration_s == 0 and not t.fits for t in result.trials if t.ram_limited)
