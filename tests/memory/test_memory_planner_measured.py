"""The planner against real allocations on the CPU (torch's profiler over the CPU allocator):
activation checkpointing lowers measured activations as much as the plan says, "-true"
precisions' fp32 norm layers are planned, and the peak is within 15%."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from torch import nn

from gpukit.memory import estimate_memory, forward_backward, measure_step_memory

sys.path.insert(0, str(Path(__file__).parent))
from planner_models import Transformer, mlp  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_checkpointing_saves_what_the_plan_says(precision: str) -> None:
    torch.manual_seed(0)
    model, tokens = Transformer(vocab=200, width=64, depth=3), torch.randint(0, 200, (8, 32))
    plans, measured = {}, {}
    for policy in (None, True):
        plans[policy] = estimate_memory(model, "adam", tokens, precision=precision, device="cpu",
                                        activation_checkpointing=policy)
        measured[policy] = measure_step_memory(copy.deepcopy(model), tokens, precision=precision,
                                               activation_checkpointing=policy)
        assert plans[policy].peak_bytes == pytest.approx(measured[policy].peak_bytes, rel=0.15)
    planned_saving = plans[None].activations_bytes - plans[True].activations_bytes
    measured_saving = measured[None].activations_bytes - measured[True].activations_bytes
    assert planned_saving > 0.3 * plans[None].activations_bytes  # checkpointing matters here
    assert planned_saving == pytest.approx(measured_saving, rel=0.15)
    assert plans[True].flops > plans[None].flops  # the recompute is counted
    assert plans[True].activation_checkpointing == "full" and "recomputed" in str(plans[True])


def test_measured_categories_match_the_plan() -> None:
    model, x = mlp(width=64, depth=2), torch.randn(32, 64)
    plan = estimate_memory(model, "adam", x, device="cpu")
    real = measure_step_memory(copy.deepcopy(model), x)
    assert real.gradients_bytes == plan.gradients_bytes and real.optimizer_state_bytes == pytest.approx(
        plan.optimizer_state_bytes, rel=0.01)
    assert real.peak_bytes == pytest.approx(plan.peak_bytes, rel=0.05)


@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.AdamW])
def test_the_foreach_step_cuda_runs_is_planned_for_cuda(optimizer: type[torch.optim.Optimizer]) -> None:
    """On CUDA torch's optimizers run their foreach variant, whose temporaries span every
    parameter at once; planning for "cuda" plans that variant (on the CPU's fake tensors, where
    torch would pick the per-tensor loop), and the CPU measures the same variant alike."""
    torch.manual_seed(0)
    model, x = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]), torch.randn(2, 256)  # the step's peak
    name = optimizer.__name__.lower()
    loop = estimate_memory(model, optimizer(model.parameters(), foreach=False), x, device="cuda")
    foreach = estimate_memory(model, optimizer(model.parameters(), foreach=True), x, device="cuda")
    assert estimate_memory(model, name, x, device="cuda") == foreach  # what CUDA picks by itself
    assert estimate_memory(model, name, x, device="cpu").peak_bytes < foreach.peak_bytes  # the CPU's loop
    assert foreach.peak_bytes - loop.peak_bytes > 0.5 * loop.parameters_bytes  # whole-list temporaries
    trained = copy.deepcopy(model)
    opt = optimizer(trained.parameters(), foreach=True)

    def step() -> None:
        with forward_backward():
            loss = trained(x).mean()
            loss.backward()
            del loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    measured = measure_step_memory(trained, x, step_fn=step)
    planned_here = estimate_memory(model, optimizer(model.parameters(), foreach=True), x, device="cpu")
    assert measured.peak_bytes == pytest.approx(planned_here.peak_bytes, rel=0.02)


def _native_cpu_bf16() -> bool:
    """Whether this CPU runs bf16 through oneDNN's native kernels, the path the planner plans (AVX-512
    BF16/AMX and the like; ``ONEDNN_MAX_CPU_ISA=AVX2`` makes an AVX-512 CPU take the other path)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # an op torch may drop: assume the planned path
        return True


@pytest.mark.requires_cpu_fsdp
@pytest.mark.slow
def test_fsdp_per_rank_peak_at_two_ranks(tmp_path: Path) -> None:
    """shard_estimate against both ranks' measured peaks under FSDP (2 gloo processes): the MLP
    whose peak the measurement used to overcount (blocks freed on gloo's thread) and the CNN
    under bf16-mixed (its BatchNorms used to fail there)."""
    import json
    import os
    import subprocess

    from gpukit.memory import shard_estimate
    from gpukit.memory import unit_param_counts, units_to_shard
    from gpukit.precision import fsdp_own_unit_layers
    from gpukit.precision import get_precision
    from gpukit.accelerators import get_accelerator
    from planner_models import BATCHES, MODELS

    configs = [("mlp", "32-true"), ("cnn", "bf16-mixed")]
    worker = Path(__file__).parents[2] / "bench" / "_planner_fsdp.py"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "gpukit", "run", "--cpu", "--nproc", "2", str(worker), str(tmp_path),
                           *(f"{name}:{precision}:none" for name, precision in configs)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"fsdp-rank{r}.json").read_text()) for r in (0, 1)]
    for (name, precision), row0, row1 in zip(configs, *ranks):
        factory, batch_of = MODELS[name]
        torch.manual_seed(0)
        model = factory()
        single = estimate_memory(model, "adam", batch_of(BATCHES[name]), precision=precision, device="cpu")
        chosen = get_precision(precision, get_accelerator("cpu"), torch.device("cpu"))
        units = units_to_shard(model, always=fsdp_own_unit_layers(chosen.name))
        assert len(units) + 1 == row0["units"]  # the plan's units are the Session's
        per_rank = shard_estimate(single, 2, unit_param_counts(model, units))
        expected = per_rank.peak_bytes
        if precision.startswith("bf16") and not _native_cpu_bf16():
            # issue 41.24: a CPU without oneDNN's bf16 kernels (no AVX-512: an AMD EPYC of the Zen 2/3 kind)
            # runs bf16 convolutions another way, with buffers the plan does not know (planned 16.6 MB,
            # measured 24.9 MB). What the test can know there: those buffers are activations, not
            # sharded, so each rank carries what one process measures beyond the plan on this CPU.
            here = measure_step_memory(copy.deepcopy(model), batch_of(BATCHES[name]), precision=precision)
            expected += here.peak_bytes - single.peak_bytes
        # the ranks run the same shapes; what the profiler misses (frees on gloo's thread) can only
        # add to a rank's measured peak, by a different amount per run (seen: +6 MiB on one rank in a
        # full CI run before the collective rule of replay_by_address): the smaller is the better one
        measured = min(row0["peak_bytes"], row1["peak_bytes"])
        assert expected == pytest.approx(measured, rel=0.15), (name, precision, expected, row0, row1)
        # sharding saves memory and the plan says so (the MLP's 3.2M parameters: a quarter of its peak)
        assert per_rank.peak_bytes < (0.8 if name == "mlp" else 1.0) * single.peak_bytes


def test_replay_by_address_frees_a_block_whose_address_is_handed_out_again() -> None:
    """A block freed on a thread the profiler does not follow (gloo's) has no free event; the
    allocator giving its address out again proves it was freed."""
    from gpukit.memory._measure_cpu import replay_by_address

    def peak(events: list[tuple[int, str, int]]) -> int:
        total = top = 0
        for _, _, delta in events:
            total += delta
            top = max(top, total)
        return top

    # 100 at 0xA freed unseen, 100 again at 0xA, then 50 at 0xB: never more than 150 live
    unseen = [(1, 0xA, 100, None), (3, 0xA, 100, None), (4, 0xB, 50, None), (5, 0xB, -50, None),
              (6, 0xA, -100, None)]
    assert peak(replay_by_address(unseen, held_bytes=10)) == 160
    # events out of order in the list; a free of a block from before the profile (live from the start)
    pre = [(4, 0xC, -30, None), (2, 0xD, 20, None), (3, 0xD, -20, None)]
    events = replay_by_address(pre, held_bytes=10)
    assert events[0] == (-1, "OTHER", 40) and peak(events) == 60 and sum(d for _, _, d in events) == 10
    # a copy made inside a collective (allocated at 1, the call returned at 2) and never seen freed
    # nor reused leaves at 2; a block outside any collective stays live (it may be the caller's)
    inside = [(1, 0xE, 100, 2), (3, 0xF, 50, None)]
    events = replay_by_address(inside, held_bytes=0)
    assert peak(events) == 100 and sum(d for _, _, d in events) == 50
