"""estimate_memory: a breakdown predicted on fake tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpukit.errors import ConfigurationError, MemoryPlanError
from gpukit.errors import DeviceError
from gpukit.memory import estimate_memory, measure_peak_memory


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))


def _param_bytes(model: nn.Module, block: int = 512) -> int:
    return sum(-(-p.numel() * p.element_size() // block) * block for p in model.parameters())


def test_breakdown_parts_match_arithmetic() -> None:
    model = _mlp()
    estimate = estimate_memory(model, "adam", torch.empty(64, 256))
    params = _param_bytes(model)
    assert estimate.parameters_bytes == params and estimate.gradients_bytes == params
    # Adam: exp_avg + exp_avg_sq per parameter, plus a tiny step counter each
    assert 2 * params <= estimate.optimizer_state_bytes <= 2 * params + 4 * 512
    assert estimate.inputs_bytes == 64 * 256 * 4
    # persistent memory alone is a lower bound of the peak; activations are on top
    assert estimate.peak_bytes >= params * 4 + estimate.inputs_bytes + estimate.activations_bytes
    assert estimate.activations_bytes >= 64 * 1024 * 4  # at least the hidden layer's output
    assert "peak" in str(estimate) and estimate.to_dict()["precision"] == "32-true"


def test_activations_scale_with_batch_and_precision_changes_bytes() -> None:
    model = _mlp()
    small = estimate_memory(model, "sgd", torch.empty(64, 256), device="cpu")
    large = estimate_memory(model, "sgd", torch.empty(512, 256), device="cpu")
    assert large.activations_bytes >= 2 * 512 * 1024 * 4  # hidden output + ReLU output, saved for backward
    assert small.activations_bytes < large.activations_bytes / 4
    assert small.optimizer_state_bytes == 0  # SGD without momentum keeps no state
    half = estimate_memory(model, "adam", torch.empty(64, 256), precision="bf16-true", device="cpu")
    full = estimate_memory(model, "adam", torch.empty(64, 256), device="cpu")
    assert half.parameters_bytes == pytest.approx(full.parameters_bytes / 2, rel=0.01)
    mixed = estimate_memory(model, "adam", torch.empty(512, 256), precision="bf16-mixed", device="cpu")
    assert mixed.parameters_bytes == full.parameters_bytes  # fp32 master weights
    assert mixed.activations_bytes < estimate_memory(model, "adam", torch.empty(512, 256), device="cpu").activations_bytes


def test_optimizer_instances_and_untouched_model() -> None:
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    adamw = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
    estimate = estimate_memory(model, adamw, torch.empty(8, 256))
    assert estimate.optimizer_state_bytes >= 2 * estimate.parameters_bytes and not estimate.notes
    assert all(p.grad is None for p in model.parameters()) and not adamw.state
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_bad_inputs() -> None:
    with pytest.raises(ConfigurationError, match="precision"):
        estimate_memory(_mlp(), "adam", torch.empty(2, 256), precision="fp8")
    with pytest.raises(ConfigurationError, match="optimizer"):
        estimate_memory(_mlp(), "lion", torch.empty(2, 256))
    with pytest.raises(ConfigurationError, match="example_batch"):
        estimate_memory(_mlp(), "adam")
    with pytest.raises(MemoryPlanError, match="could not trace"):
        estimate_memory(_mlp(), "adam", torch.empty(2, 7))  # wrong feature size


@pytest.mark.parametrize("device", ["tpu", "gpu", "meta", "cuda:x"])
def test_unsupported_device_lists_the_supported_types(device: str) -> None:
    with pytest.raises(ConfigurationError, match=rf"device='{device}'.*'cuda', 'cpu', 'mps'"):
        estimate_memory(_mlp(), "adam", torch.empty(2, 256), device=device)


def _small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(128, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10),
    )


def _small_transformer() -> nn.Module:
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True, dropout=0.0), 4)


@pytest.mark.requires_gpu
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("factory,shape", [(_small_cnn, (64, 3, 32, 32)), (_small_transformer, (32, 128, 256))])
def test_estimate_within_15_percent_of_measured_gpu_peak(factory, shape, precision: str) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = factory()
    estimate = estimate_memory(model, "adam", torch.empty(shape), precision=precision, device="cuda")
    measured = measure_peak_memory(model, torch.randn(shape), precision=precision)
    assert estimate.peak_bytes == pytest.approx(measured, rel=0.15), (str(estimate), measured)


@pytest.mark.requires_gpu
@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_an_optimizer_step_peak_is_planned_as_cuda_runs_it(optimizer: str) -> None:
    """A model whose peak is its optimizer step: CUDA runs torch's foreach variant (temporaries
    across every parameter), and the plan for "cuda" plans that variant."""
    torch.manual_seed(0)
    model, x = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)]), torch.randn(2, 2048)
    estimate = estimate_memory(model, optimizer, x, device="cuda")
    measured = measure_peak_memory(model, x, optimizer=optimizer)
    assert estimate.peak_bytes == pytest.approx(measured, rel=0.05), (str(estimate), measured)


def test_measure_peak_memory_refuses_a_device_that_counts_nothing() -> None:
    with pytest.raises(DeviceError, match="counts allocations"):
        measure_peak_memory(nn.Linear(4, 4), torch.randn(2, 4), device="cpu")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("precision,checkpointing", [("32-true", None), ("bf16-mixed", True), ("bf16-true", True)])
def test_the_derived_second_step_equals_simulating_it(monkeypatch: pytest.MonkeyPatch, device: str,
                                                      precision: str, checkpointing: object) -> None:
    import sys
    from pathlib import Path

    from gpukit.memory import _planner

    sys.path.insert(0, str(Path(__file__).parent))
    from planner_models import Transformer

    model = Transformer(depth=2)
    batch = torch.randint(0, 1000, (8, 32))
    for optimizer in ("adam", torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)):
        got = {}
        for steps in (1, 2):
            monkeypatch.setattr(_planner, "_SIMULATED_STEPS", steps)
            got[steps] = estimate_memory(model, optimizer, batch, precision=precision, device=device,
                                         activation_checkpointing=checkpointing).to_dict()
        assert got[1] == got[2], (optimizer, got)
