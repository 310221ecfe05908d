"""What the set-up model's own autocast costs per call (issue 37 item 0), side by side in one run.

``session.setup`` makes a "-mixed" model's forward run under autocast by itself
(``gpukit.precision.AutocastForward``). This measures, per forward call of a tiny model (so the
wrapper's cost is not hidden in the maths), interleaved round by round, the minimum over rounds
of this thread's CPU time per call (robust to a loaded machine):

- plain: the model set up at "32-true" (the same gpukit hooks, e.g. the inference guard, but no
  autocast forward) inside the bf16 ``session.autocast()``: the old loop's cost;
- nested: the set-up model inside ``session.autocast()`` (the old loop, unchanged: must cost ~0);
- alone: the set-up model with no ``session.autocast()`` (the loop ported from Accelerate/Fabric).

Two models: ``Identity`` (fp32 in, fp32 out: the wrapper alone) and ``Linear`` (bf16 out: adds the
cast of the output to fp32, which a loss under autocast would do anyway).

    python bench/autocast_forward.py [--rounds 15] [--calls 5000]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import nn

import gpukit


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    # this thread's CPU time, not wall time: the machine's other processes do not count (one torch
    # thread, so all of a call's work is on this thread)
    start = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    session = gpukit.Session(accelerator="cpu", precision="bf16-mixed", verbose=False)
    fp32 = gpukit.Session(accelerator="cpu", precision="32-true", verbose=False)
    x = torch.randn(2, 4)
    for name, make in (("Identity", nn.Identity), ("Linear", lambda: nn.Linear(4, 4))):
        plain, set_up = fp32.setup(make()), session.setup(make())

        def under_session_autocast(model: nn.Module) -> Callable[[], object]:
            def call() -> object:
                with session.autocast():
                    return model(x)
            return call

        cases = {"plain": under_session_autocast(plain), "nested": under_session_autocast(set_up),
                 "alone": lambda: set_up(x)}
        times: dict[str, list[float]] = {case: [] for case in cases}
        for _ in range(args.rounds):
            for case, fn in cases.items():
                times[case].append(per_call_us(fn, args.calls))
        best = {case: min(values) for case, values in times.items()}
        print(f"{name:8s} per call (min of {args.rounds} rounds): plain {best['plain']:.2f} us | "
              f"nested {best['nested']:.2f} us ({best['nested'] - best['plain']:+.2f}) | "
              f"alone {best['alone']:.2f} us ({best['alone'] - best['plain']:+.2f})")


if __name__ == "__main__":
    main()
