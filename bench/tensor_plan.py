"""Does ``plan --fit`` choose tensor parallelism where it pays, and only there? (issue 38's planner goal)

Transformers whose attention materialises its scores (as eager attention does; the tests' ``LM`` of
tests/memory/test_memory_fit_tensor.py at larger sizes), planned for 8 GPUs of one node, each at two budgets:

- **tight**: just under the least peak any layout *without* tensor groups reaches (FSDP over 8 at one
  sample per device, full checkpointing): the per-rank activations do not fit under FSDP alone, so a
  tensor group must be chosen;
- **roomy**: 80 GiB per device: everything fits, and tensor groups are chosen only where the cost model
  says they pay -- the compute per device is the same with or without them, their collectives come on
  top, and what they save is the data-parallel traffic of the parameters each rank no longer holds
  whole (FSDP gathers half as much under tensor x2). The "wide" model (512 wide, 1024 tokens, 8 per
  batch) has parameters enough for that to pay; the "narrow" one (128 wide, 512 tokens, 64 per batch)
  moves more activations than parameters, and should not take them.

Prints the per-degree lines of each, and the planner's time (CPU processes; nothing is allocated).

Run: ``python bench/tensor_plan.py`` (both models), or one model: ``--width 512 --heads 8 --depth 4 --seq 1024
--batch 8``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "memory"))
import test_memory_fit_tensor as models  # noqa: E402

from gpukit.memory import FitPlanner, available_workers, fit  # noqa: E402


#: name -> (width, heads, depth, tokens per sample, global batch)
CASES = {"wide": (512, 8, 4, 1024, 8), "narrow": (128, 8, 4, 512, 64)}


def run(name: str, width: int, heads: int, depth: int, seq: int, batch: int, devices: int) -> None:
    models.SEQ = seq
    with torch.device("meta"):
        model = models.LM(hidden=width, heads=heads, depth=depth)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    kwargs = dict(devices=devices, device="cuda", precisions=["bf16-mixed"], checkpointing=["none", "full"],
                  top=3, workers=available_workers())
    planner = FitPlanner(model, ids, "adamw", "cuda")
    start = time.perf_counter()
    least = fit(model, ids, memory=1, tensor_parallel=(), planner=planner, **kwargs).closest.peak_bytes
    results = {"tight": fit(model, ids, memory=least - 1, planner=planner, **kwargs),
               "roomy": fit(model, ids, memory="80GiB", planner=planner, **kwargs)}
    took = time.perf_counter() - start
    print(f"== {name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, {heads} heads, "
          f"batch {batch} x {seq} tokens, {devices} devices; least peak without tensor groups "
          f"{least / 2**20:.1f} MiB; {planner.plans} plans in {took:.1f} s")
    for budget, result in results.items():
        best = result.best
        chose = "nothing fits" if best is None else (f"tensor x{best.layout.tensor}" if best.layout.tensor > 1
                                                      else "no tensor groups")
        print(f"  {budget}: chose {chose}" + (f" -- {best.describe()}" if best else ""))
        for line in result.tensor:
            print(f"    {line}")
    print()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for option in ("width", "heads", "depth", "seq", "batch"):
        parser.add_argument(f"--{option}", type=int, default=None)
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args(argv)
    given = [getattr(args, o) for o in ("width", "heads", "depth", "seq", "batch")]
    cases = CASES if all(v is None for v in given) else {
        "given": tuple(v if v is not None else d for v, d in zip(given, CASES["wide"]))}
    torch.manual_seed(0)
    for name, case in cases.items():
        run(name, *case, devices=args.devices)


if __name__ == "__main__":
    main()
