"""Worker of bench/planner.py: FSDP at 2 ranks (`gpukit run --cpu --nproc 2`, gloo).

For every model x precision x activation checkpointing it sets the model up with
``Session(strategy="fsdp")``, measures two real training steps on this rank
(``measure_step_memory`` with ``step_fn``) and writes <out>/fsdp-rank<R>.json.

Arguments: <out> then models (``mlp``: its 6 configurations) or single configurations
(``mlp:32-true:none``, ``cnn:bf16-mixed:full``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import gpukit
from gpukit.memory._measure_cpu import forward_backward, measure_step_memory

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "memory"))
from planner_models import BATCHES, MODELS  # noqa: E402


def measure(name: str, precision: str, checkpointing: object) -> dict:
    session = gpukit.Session(accelerator="cpu", strategy="fsdp", precision=precision, verbose=False,
                             activation_checkpointing=checkpointing)
    factory, batch_of = MODELS[name]
    torch.manual_seed(0)
    model = factory()
    optimizer = torch.optim.Adam(model.parameters())
    model, optimizer = session.setup(model, optimizer)
    batch = batch_of(BATCHES[name])

    def step() -> None:
        with forward_backward():
            with session.autocast():
                output = model(batch)
                output = output["logits"] if isinstance(output, dict) else output  # Hugging Face: ModelOutput
                loss = output.float().mean()
            session.backward(loss)
            del output, loss
        session.step(optimizer)

    measured = measure_step_memory(model, batch, step_fn=step)
    return {"model": name, "precision": precision, "ac": checkpointing is not None, "rank": session.rank,
            "units": len(session.strategy.units or []) + 1, **measured.to_dict()}


def configurations(specs: list[str]) -> list[tuple[str, str, object]]:
    out = []
    for spec in specs:
        name, *rest = spec.split(":")
        if name not in MODELS or len(rest) not in (0, 2) or (rest and rest[1] not in ("none", "full")):
            raise SystemExit(f"bad configuration {spec!r}: use a model ({', '.join(MODELS)}) or model:precision:none|full")
        if rest:
            out.append((name, rest[0], True if rest[1] == "full" else None))
        else:
            out += [(name, precision, ac) for precision in ("32-true", "bf16-mixed", "bf16-true") for ac in (None, True)]
    return out


def main(out: Path, specs: list[str]) -> None:
    rows = [measure(name, precision, ac) for name, precision, ac in configurations(specs)]
    rank = rows[0]["rank"]
    (out / f"fsdp-rank{rank}.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
