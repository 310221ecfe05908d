"""The plan's predicted host peak against the bytes the load and a ``generate`` really allocate.

Measured in-process with torch's profiler (every CPU-allocator allocation and free, in order), not
with RSS: the figure is the tensors gpukit and the model hold, which is what the plan predicts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import gpukit
from gpukit.inference import _bandwidth
from inference_models import tiny_llama


def _peak_allocated_bytes(prof: Any) -> int:
    """The highest running total of the CPU allocations the profiler recorded."""
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    held = peak = 0
    for event in events:
        held += event.nbytes()
        peak = max(peak, held)
    return peak


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama of ~10 MiB (wider than the other tests' model, so the weights, not Python's own
    allocations, make the peak), saved as safetensors."""
    model = tiny_llama(tied=False, layers=2, hidden=256, vocab=2048)
    folder = tmp_path_factory.mktemp("wide-llama")
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("probe_runs", [True, False], ids=["first-plan-of-a-process", "probe-already-measured"])
def test_the_predicted_host_peak_is_what_the_load_and_generate_allocate(
        wide_llama: Path, monkeypatch: pytest.MonkeyPatch, probe_runs: bool) -> None:
    # a fresh process measures host bandwidth once, inside its first plan (its buffer held then, before
    # any weight); a later plan reuses the figure, and only the model's own tensors make the peak
    monkeypatch.setattr(_bandwidth, "_host_cache", [] if probe_runs else [10e9])
    ids = torch.randint(0, 2048, (1, 16), generator=torch.Generator().manual_seed(0))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = gpukit.load_for_inference(wide_llama, max_memory={"cpu": "1GiB"}, batch_size=1, prompt_len=16,
                                          new_tokens=4)
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                           pad_token_id=0)
    predicted = model.gpukit_inference.plan.peak_bytes("cpu")
    measured = _peak_allocated_bytes(prof)
    assert measured > 0
    assert abs(measured / predicted - 1) <= 0.10, (
        f"predicted host peak {predicted / 2**20:.2f} MiB, allocated {measured / 2**20:.2f} MiB")
