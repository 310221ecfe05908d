"""``fit``'s search (memory/_fit_search.py) against the search it must agree with: every
configuration planned exactly at its micro-batch, ranked by step time and then peak. The same
options in the same order, the same closest configuration when none fits and the same cheaper
one left out -- from fewer plans."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from gpukit.layout import plan_layout
from gpukit.memory import FitPlanner, fit, fsdp_unit_numels
from gpukit.memory._fit_costs import Costs, option_for
from gpukit.memory._fit_tensor import tensor_degrees

sys.path.insert(0, str(Path(__file__).parent))
from planner_models import Transformer, mlp  # noqa: E402

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
POLICIES = ("none", "selective", "full")
TOP = 4


def _case(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if name == "mlp":
        return mlp(width=32, depth=3), torch.randn(16, 64)
    return Transformer(width=32, depth=2), torch.randint(0, 1000, (8, 16))


def _every_option(model: torch.nn.Module, x: torch.Tensor, devices: int, planner: FitPlanner) -> list:
    """Every configuration fit considers, each from its own exact plan, cheapest first."""
    batch = x.shape[0]
    degrees = tensor_degrees(planner, devices, None, devices, PRECISIONS) if devices > 1 else None
    costs = Costs(100e12, 100e9, 20e9, 2e-3, {p: fsdp_unit_numels(model, p) for p in PRECISIONS},
                  tensor=degrees.costs if degrees else {})
    strategies = ["single"] if devices == 1 else ["single", "ddp", "fsdp", "fsdp-offload"]
    if devices > 1 and isinstance(model, torch.nn.Sequential):
        strategies.append("pipeline")
    strategies += [f"tp{t}" for t in (degrees.accepted if degrees else ())]  # groups of all the devices
    options = []
    for precision in PRECISIONS:
        for ckpt in POLICIES:
            for strategy in strategies:
                layout = plan_layout(strategy, 1 if strategy == "single" else devices)
                per_device = batch // layout.data_parallel_size
                micro = per_device
                while True:
                    options.append(option_for(planner.exact(precision, ckpt, micro, layout.tensor), precision, ckpt,
                                              layout, micro, per_device // micro, costs, exact=True))
                    if micro % 2:
                        break
                    micro //= 2
    return sorted(options, key=lambda o: (o.step_s, o.peak_bytes))


# make test: two devices on the MLP (tensor groups, and planned ahead in child processes) and one on the
# transformer (heads); the other two pairs with --extended.
@pytest.mark.parametrize(("name", "devices"), [
    ("mlp", 2), ("transformer", 1),
    pytest.param("mlp", 1, marks=pytest.mark.extended), pytest.param("transformer", 2, marks=pytest.mark.extended),
])
def test_the_search_finds_what_planning_everything_finds(name: str, devices: int) -> None:
    model, x = _case(name)
    everything = _every_option(model, x, devices, FitPlanner(model, x, "adam", "cuda"))
    peaks = sorted(o.peak_bytes for o in everything)
    all_plans = len({(o.precision, o.activation_checkpointing, o.micro_batch, o.layout.tensor) for o in everything})
    assert devices == 1 or any(o.layout.tensor == 2 for o in everything)  # tensor groups are searched too
    budgets = {"none fits": peaks[0] - 1, "none fits by far": peaks[0] // 2, "a quarter fits": peaks[len(peaks) // 4],
               "half fits": peaks[len(peaks) // 2], "all fit": peaks[-1]}
    for what, budget in budgets.items():
        fits = [o for o in everything if o.peak_bytes <= budget]
        first_fit = everything.index(fits[0]) if fits else len(everything)
        left_out = next((o for o in everything[:first_fit] if o.peak_bytes > budget), None)
        planner = FitPlanner(model, x, "adam", "cuda")
        result = fit(model, x, memory=budget, devices=devices, top=TOP, planner=planner)
        assert result.options == tuple(fits[:TOP]), what
        assert result.cheaper_rejected == left_out, what
        if fits:
            assert result.closest is None, what
        else:
            assert result.closest == min(everything, key=lambda o: o.peak_bytes), what
        assert planner.plans < all_plans, (what, planner.plans, all_plans)
        print(f"{name} x{devices} {what}: {planner.plans} plans of {all_plans}")
        if name == "mlp" and devices == 2 and what == "a quarter fits":  # planned ahead in children: the same
            side_by_side = fit(model, x, memory=budget, devices=devices, top=TOP, workers=2)
            assert (side_by_side.options, side_by_side.cheaper_rejected) == (result.options, result.cheaper_rejected)


def test_progress_says_each_plan_before_it_is_made() -> None:
    model, x = _case("mlp")
    lines: list[str] = []
    planner = FitPlanner(model, x, "adam", "cuda")
    fit(model, x, memory="1GiB", top=2, planner=planner, progress=lines.append)
    assert len(lines) == planner.plans and all(line.startswith("planning ") for line in lines)
    assert lines[0] == "planning bf16-true, checkpointing none, micro-batch 16 (0 planned so far)"


def test_the_status_line_is_drawn_on_a_terminal_only() -> None:
    import io

    from gpukit.cli.plan import StatusLine

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal, log = Terminal(), io.StringIO()
    for stream in (terminal, log):
        with StatusLine(stream) as status:
            status.show("planning one")
            status.show("planning " + "x" * 10_000)
    assert terminal.getvalue().startswith("\r\x1b[Kplanning one\r\x1b[Kplanning xx")
    assert terminal.getvalue().endswith("x\r\x1b[K") and len(terminal.getvalue()) < 1000  # cut, then wiped
    assert log.getvalue() == ""
