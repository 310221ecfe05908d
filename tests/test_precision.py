"""gpukit.precision on the CPU (where torch supports it) and on GPUs (marked)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpukit.accelerators import CPUAccelerator, CUDAAccelerator
from gpukit.errors import ConfigurationError
from gpukit.precision import MixedPrecision, Precision, TruePrecision, get_precision

CPU = torch.device("cpu")


def cpu_precision(name: str) -> Precision:
    return get_precision(name, CPUAccelerator(), CPU)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
        nn.LayerNorm(4 * 6 * 6), nn.Linear(4 * 6 * 6, 2),
    )


class OldGpu(CUDAAccelerator):
    def supports_bf16(self, device: torch.device | None = None) -> bool:
        return False


class Ampere(CUDAAccelerator):
    def supports_bf16(self, device: torch.device | None = None) -> bool:
        return True


class NoFp16(CPUAccelerator):
    def supports_fp16_autocast(self) -> bool:
        return False


def test_unknown_precision_lists_the_allowed_values() -> None:
    with pytest.raises(ConfigurationError, match="'32-true', 'bf16-mixed', '16-mixed'"):
        cpu_precision("fp8")


@pytest.mark.parametrize(
    ("alias", "name"),
    [("32", "32-true"), (32, "32-true"), ("16", "16-mixed"), (16, "16-mixed"),
     ("bf16", "bf16-mixed"), ("fp32", "32-true"), ("float32", "32-true"), ("FP32", "32-true")],
)
def test_aliases(alias: object, name: str) -> None:
    assert get_precision(alias, CPUAccelerator(), CPU).name == name  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("alias", "hint"),
    [("fp16", "'16-mixed'"), ("float16", "'16-mixed'"), ("half", "'16-true'"),
     ("bfloat16", "'bf16-mixed'")],
)
def test_ambiguous_aliases_are_refused_with_a_suggestion(alias: str, hint: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        cpu_precision(alias)
    message = str(info.value)
    assert "Did you mean" in message and hint in message
    assert "'32-true', 'bf16-mixed', '16-mixed'" in message  # still lists the allowed values


@pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler is enabled")
def test_auto_is_32_true_on_cpu_and_mixed_on_gpus() -> None:
    assert cpu_precision("auto").name == "32-true"
    cuda = torch.device("cuda", 0)
    assert get_precision("auto", Ampere(), cuda).name == "bf16-mixed"
    assert get_precision("auto", OldGpu(), cuda).name == "16-mixed"


@pytest.mark.parametrize("name", ["bf16-mixed", "bf16-true"])
def test_bf16_on_a_gpu_without_native_bf16_is_an_error(name: str) -> None:
    with pytest.raises(ConfigurationError, match="compute capability 8.0"):
        get_precision(name, OldGpu(), torch.device("cuda", 0))


def test_fp16_autocast_where_unsupported_is_an_error() -> None:
    with pytest.raises(ConfigurationError, match="'16-mixed' needs float16 autocast"):
        get_precision("16-mixed", NoFp16(), CPU)


def test_bf16_mixed_autocasts_on_cpu_and_keeps_fp32_weights() -> None:
    precision = cpu_precision("bf16-mixed")
    model = precision.convert_module(net())
    with precision.autocast():
        out = model(torch.randn(2, 3, 8, 8))
    assert out.dtype == torch.bfloat16 and precision.scaler is None
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize(("name", "dtype"), [("bf16-true", torch.bfloat16), ("16-true", torch.float16)])
def test_true_precisions_keep_norm_layers_fp32(name: str, dtype: torch.dtype) -> None:
    precision = cpu_precision(name)
    assert isinstance(precision, TruePrecision)
    model = precision.convert_module(net())
    precision.convert_module(model)  # twice: hooks must not stack
    assert model[0].weight.dtype == dtype and model[5].weight.dtype == dtype
    assert model[1].weight.dtype == torch.float32 and model[1].running_mean.dtype == torch.float32
    assert model[4].weight.dtype == torch.float32
    out = model(torch.randn(2, 3, 8, 8))  # fp32 input is cast in, fp32 comes out
    assert out.dtype == torch.float32
    out.sum().backward()
    assert model[0].weight.grad.dtype == dtype and model[1].weight.grad.dtype == torch.float32


def test_16_mixed_skips_the_step_on_inf_and_recovers() -> None:
    precision = cpu_precision("16-mixed")
    assert isinstance(precision, MixedPrecision) and precision.scaler is not None
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.full((2, 3), 1e-4)  # small: the scaled fp16 gradients stay finite

    def backward() -> None:
        with precision.autocast():
            loss = model(x).float().mean()
        precision.scale_loss(loss).backward()

    backward()
    model.weight.grad[0, 0] = float("inf")
    before, scale = model.weight.detach().clone(), precision.scaler.get_scale()
    assert precision.optimizer_step(optimizer) is False
    assert torch.equal(model.weight, before) and precision.scaler.get_scale() < scale
    optimizer.zero_grad()
    backward()
    assert precision.optimizer_step(optimizer) is True
    assert not torch.equal(model.weight, before)


@pytest.mark.parametrize("kernel", [{"fused": True}, {"foreach": True}])
def test_16_mixed_says_a_fused_optimizers_inf_step_was_skipped(kernel: dict[str, bool]) -> None:
    """A fused optimizer (AdamW(fused=True)) skips an inf step inside its own kernel, but GradScaler still
    calls its step(): session.step returned True for a step that did not happen, counted it in
    optimizer_steps and stepped the schedulers."""
    import gpukit

    session = gpukit.Session(accelerator="cpu", precision="16-mixed", verbose=False)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, **kernel)
    model, optimizer = session.setup(model, optimizer)
    x = torch.full((2, 3), 1e-4)  # small: the scaled fp16 gradients stay finite
    session.backward(model(x).mean())
    model.weight.grad[0, 0] = float("inf")
    before = model.weight.detach().clone()
    assert session.step(optimizer, clip_grad_norm=1.0) is False
    assert torch.equal(model.weight, before) and session.optimizer_steps == 0
    session.backward(model(x).mean())
    assert session.step(optimizer, clip_grad_norm=1.0) is True
    assert not torch.equal(model.weight, before) and session.optimizer_steps == 1


def test_16_mixed_step_after_a_plain_backward_says_to_use_session_backward() -> None:
    precision = cpu_precision("16-mixed")
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 3)).mean().backward()  # not precision.scale_loss(loss).backward()
    with pytest.raises(ConfigurationError, match=r"session.backward\(loss\)"):
        precision.optimizer_step(optimizer)
    with pytest.raises(ConfigurationError, match=r"session.backward\(loss\)"):
        precision.unscale_(optimizer)
    # after one good step, a plain backward is still caught (the scale exists by then)
    precision.scale_loss(model(torch.ones(2, 3)).mean()).backward()
    assert precision.optimizer_step(optimizer) is True
    model(torch.ones(2, 3)).mean().backward()
    with pytest.raises(ConfigurationError, match="loss.backward()"):
        precision.optimizer_step(optimizer)


def test_a_mixed_precision_object_pickles_to_launched_workers() -> None:
    """Session(precision=MixedPrecision(...)).launch(fn) pickles it to the workers: its WeakSet of watched
    optimizers made launch fail with 'its args must be picklable ... WeakSet'."""
    import pickle

    precision = cpu_precision("16-mixed")
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precision.scale_loss(model(torch.ones(2, 3)).mean()).backward()
    assert precision.optimizer_step(optimizer) is True  # an optimizer is watched, the scale exists
    copy = pickle.loads(pickle.dumps(precision))
    assert isinstance(copy, MixedPrecision) and copy.name == "16-mixed"
    assert copy.scaler.get_scale() == precision.scaler.get_scale()
    other = nn.Linear(3, 1)
    other_optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    before = other.weight.detach().clone()
    copy.scale_loss(other(torch.ones(2, 3)).mean()).backward()
    assert copy.optimizer_step(other_optimizer) is True and not torch.equal(other.weight, before)


def test_scaler_state_round_trips() -> None:
    a, b = cpu_precision("16-mixed"), cpu_precision("16-mixed")
    a.scaler.scale(torch.ones(()))  # the scale tensor exists from the first scale() on
    a.scaler.update(new_scale=128.0)
    b.load_state_dict(a.state_dict())
    assert b.scaler.get_scale() == 128.0
    assert cpu_precision("32-true").state_dict() == {}


@pytest.mark.requires_gpu
def test_gpu_16_mixed_with_gradscaler_skips_inf_step() -> None:
    device = torch.device("cuda", 0)
    precision = get_precision("16-mixed", CUDAAccelerator(), device)
    model = nn.Linear(8, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with precision.autocast():
        out = model(torch.randn(4, 8, device=device))
    assert out.dtype == torch.float16
    precision.scale_loss(out.float().sum()).backward()
    model.bias.grad.fill_(float("nan"))
    before = model.weight.detach().clone()
    assert precision.optimizer_step(optimizer) is False
    assert torch.equal(before, model.weight)


@pytest.mark.requires_gpu
def test_gpu_bf16_mixed_and_true() -> None:
    device = torch.device("cuda", 0)
    if not CUDAAccelerator().supports_bf16(device):
        pytest.skip("GPU without native bf16")
    mixed = get_precision("bf16-mixed", CUDAAccelerator(), device)
    model = net().to(device)
    with mixed.autocast():
        assert model(torch.randn(2, 3, 8, 8, device=device)).dtype == torch.bfloat16
    true = get_precision("bf16-true", CUDAAccelerator(), device)
    model = true.convert_module(net().to(device))
    assert model(torch.randn(2, 3, 8, 8, device=device)).dtype == torch.float32
    assert model[1].weight.dtype == torch.float32
