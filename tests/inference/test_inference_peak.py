"""The plan's predicted host peak against the bytes the load and a ``generate`` really allocate.

Measured in-process with torch's profiler (every CPU-allocator allocation and free, in order), not
with RSS: the figure is the tensors gpukit and the model hold, which is what the plan predicts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import gpukit
from gpukit.inference import _bandwidth, _load
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


def _measure(folder: str, probe_runs: bool, weights: str | None = None) -> tuple[int, int]:
    """(predicted host peak, peak bytes allocated) of a load and a ``generate`` in this process."""
    # a fresh process measures host bandwidth once, inside its first plan (its buffer held then, before
    # any weight); a later plan reuses the figure, and only the model's own tensors make the peak
    if not probe_runs:
        _bandwidth._host_cache[:] = [10e9]
    # resident host weights live in a huge-page mapping outside torch's allocator, where the profiler does
    # not see them: here they take the same bytes from torch's allocator (test_inference_hostmem.py checks
    # that the mapping holds no more than its bytes)
    _load.host_weights_buffer = lambda nbytes: torch.empty(nbytes, dtype=torch.uint8)
    ids = torch.randint(0, 2048, (1, 16), generator=torch.Generator().manual_seed(0))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = gpukit.load_for_inference(folder, max_memory={"cpu": "1GiB"}, batch_size=1, prompt_len=16,
                                          new_tokens=4, weights=weights)
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                           pad_token_id=0)
    return model.gpukit_inference.plan.peak_bytes("cpu"), _peak_allocated_bytes(prof)


@pytest.mark.parametrize(("probe_runs", "weights"), [(True, None), (False, None), (False, "int8")],
                         ids=["first-plan-of-a-process", "probe-already-measured", "int8-weights"])
def test_the_predicted_host_peak_is_what_the_load_and_generate_allocate(wide_llama: Path, probe_runs: bool,
                                                                        weights: str | None) -> None:
    # in a fresh process: the profiler's allocation records and the probe's once-per-process cache are
    # then this load's alone, whatever other tests ran before in this one. With int8 weights the peak
    # holds the quantised weights plus a Linear's transient float copy (at load: the tensor read before
    # it is quantised; in the forward: the upcast), which the plan counts in the activations
    proc = subprocess.run([sys.executable, __file__, str(wide_llama), str(int(probe_runs)), weights or ""],
                          capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr[-2000:]
    predicted, measured = json.loads(proc.stdout.strip().splitlines()[-1])
    assert measured > 0
    assert abs(measured / predicted - 1) <= 0.10, (
        f"predicted host peak {predicted / 2**20:.2f} MiB, allocated {measured / 2**20:.2f} MiB")


if __name__ == "__main__":
    print(json.dumps(_measure(sys.argv[1], bool(int(sys.argv[2])), sys.argv[3] or None)))
