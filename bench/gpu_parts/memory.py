"""gpu-check part `memory`: the planner's estimate against torch.cuda.max_memory_allocated.

The CPU table's models (tests/memory/planner_models.py: an MLP, a CNN, a small transformer, a
Hugging Face Llama from a config when transformers is installed) at 32-true, bf16-mixed and
bf16-true, two Adam steps each: estimate / measured peak within 15% is the goal. In a dry run
the estimate is made for "cuda" on the CPU (no GPU needed) and nothing is measured.
"""

from __future__ import annotations

import sys

from _common import DRY, ROOT, emit, guarded

sys.path.insert(0, str(ROOT / "tests" / "memory"))
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")


def row(name: str, precision: str) -> None:
    import torch

    from gpukit.memory import estimate_memory, measure_peak_memory
    from planner_models import BATCHES, MODELS

    factory, batch_of = MODELS[name]
    torch.manual_seed(0)
    model, batch = factory(), batch_of(2 if DRY else BATCHES[name])
    estimate = estimate_memory(model, "adam", batch, precision=precision, device="cuda")
    if DRY:
        emit(f"{name} {precision}", "skip", estimate.peak_bytes / 2**20, "MiB est.", "dry run: nothing to measure")
        return
    measured = measure_peak_memory(model, batch, precision=precision)
    ratio = estimate.peak_bytes / measured
    emit(f"{name} {precision}", "ok" if abs(ratio - 1) <= 0.15 else "warn", ratio, "est/measured",
         f"{estimate.peak_bytes / 2**20:.1f} / {measured / 2**20:.1f} MiB")
    del model
    torch.cuda.empty_cache()


def main() -> None:
    from planner_models import MODELS

    for name in MODELS:
        try:
            MODELS[name][0]()
        except ImportError as exc:
            emit(name, "skip", detail=f"{exc}")
            continue
        for precision in PRECISIONS[:1] if DRY else PRECISIONS:  # a dry run checks the code path once a model
            guarded(f"{name} {precision}", row, name, precision)


if __name__ == "__main__":
    main()
