"""Session(auto=..., refuse=...): the automatic settings, each decided from facts with its printed reason.

The decisions are a pure function of facts, so GPU-like facts (an H100, a T4, a launch-bound step)
are fed here on the CPU; applying them is checked with a fake GPU-like accelerator on CPU tensors
(fused AdamW and channels_last run on the CPU too); the kernel window is measured for real on CUDA
(``requires_gpu``).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import gpukit
from gpukit.layout import Layout
from gpukit.accelerators import CPUAccelerator, KernelWindow, SpeedTraits, get_accelerator
from gpukit.errors import ConfigurationError
from gpukit.precision import get_precision
from gpukit.session._auto import MEASURED_STEPS, WARMUP_STEPS, SessionAuto, model_facts, optimizer_facts
from gpukit.session._auto_decide import (
    AUTO_SETTINGS, COMPILE_COST_S, MeasuredFacts, SetupFacts, check_auto, decide_measured, decide_setup,
    resolve_auto_precision,
)
from gpukit.strategies import SingleDeviceStrategy

H100 = SetupFacts(device="NVIDIA H100 80GB HBM3", host=False, capability=(9, 0), tf32=True, tensor_cores=True,
                  cuda_graphs=True, flash_attention=True, precision_asked="auto", precision="bf16-mixed",
                  strategy="single", conv2d_layers=53, attention_layers=0, optimizer="AdamW", param_tensors=161)
CPU = SetupFacts(device="cpu", host=True, capability=None, tf32=False, tensor_cores=False, cuda_graphs=False,
                 flash_attention=False, precision_asked="auto", precision="32-true", strategy="single",
                 conv2d_layers=2, attention_layers=1, optimizer="AdamW", param_tensors=6)


def _by_name(decisions: list) -> dict:
    return {d.name: d for d in decisions}


def test_an_h100_convnet_gets_every_setup_setting_with_its_reason() -> None:
    got = _by_name(decide_setup(H100))
    assert set(got) == {"bf16", "tf32", "fused_optimizer", "channels_last", "attention"}
    assert str(got["bf16"]).startswith("bf16: on (precision='auto' on NVIDIA H100 80GB HBM3 [sm_90] with native bf16")
    assert str(got["tf32"]).startswith("tf32: on (fp32 matmuls outside autocast on TF32 tensor cores")
    assert str(got["fused_optimizer"]) .startswith("fused_optimizer: on (AdamW with fused=True: one kernel per step over 161")
    assert str(got["channels_last"]).startswith("channels_last: on (53 Conv2d layer(s) on tensor cores")
    assert str(got["attention"]) == ("attention: off (no attention layer: no nn.MultiheadAttention, "
                                     "no scaled_dot_product_attention call)")


def test_on_the_cpu_every_setting_is_off_with_a_reason() -> None:
    got = _by_name(decide_setup(CPU))
    assert not any(d.on for d in got.values())
    assert got["tf32"].reason == "the CPU: TF32 tensor cores need an Ampere+ GPU"
    assert got["fused_optimizer"].reason.startswith("the CPU")
    assert got["channels_last"].reason.startswith("the CPU")
    assert got["attention"].reason == "the CPU: torch picks its CPU kernel"


def test_older_gpus_explicit_precisions_and_sharded_strategies() -> None:
    t4 = dataclasses.replace(H100, device="Tesla T4", capability=(7, 5), tf32=False, flash_attention=False,
                             precision="16-mixed", attention_layers=4)
    got = _by_name(decide_setup(t4))
    assert str(got["bf16"]) == "bf16: off (Tesla T4 [sm_75] has no native bf16: precision='auto' is 16-mixed)"
    assert not got["tf32"].on and got["channels_last"].on  # fp16 tensor cores still like NHWC
    assert got["attention"].on and "flash needs Ampere+" in got["attention"].reason
    exact = _by_name(decide_setup(dataclasses.replace(H100, precision_asked="32-true", precision="32-true")))
    assert str(exact["tf32"]) == "tf32: off (precision='32-true' asked for: fp32 matmuls kept at full precision)"
    assert not exact["channels_last"].on  # fp32 convolutions without TF32: no tensor cores
    fsdp = _by_name(decide_setup(dataclasses.replace(H100, strategy="fsdp", layout=Layout(shards=2),
                                                       plain_parameters=False)))
    one = _by_name(decide_setup(dataclasses.replace(H100, strategy="fsdp", plain_parameters=False)))  # world 1
    assert not one["fused_optimizer"].on and not one["channels_last"].on
    assert not fsdp["fused_optimizer"].on and not fsdp["channels_last"].on
    mine = _by_name(decide_setup(dataclasses.replace(H100, optimizer_kernel="foreach")))
    assert str(mine["fused_optimizer"]) == "fused_optimizer: off (foreach kernel set on the optimizer: kept)"
    other = _by_name(decide_setup(dataclasses.replace(H100, optimizer="Lion")))
    assert "Lion has no fused kernel" in other["fused_optimizer"].reason


def test_each_setting_is_refused_by_name() -> None:
    for name in ("tf32", "fused_optimizer", "channels_last"):
        got = _by_name(decide_setup(dataclasses.replace(H100, attention_layers=2), frozenset({name})))
        assert str(got[name]) == f"{name}: off (refused by name)"
        assert all(d.on for n, d in got.items() if n != name)  # the others unchanged
    got = _by_name(decide_setup(dataclasses.replace(H100, attention_layers=2), frozenset({"attention"})))
    assert str(got["attention"]) == "attention: off (refused by name)"
    # bf16 refused: precision="auto" resolves to 32-true instead of bf16-mixed
    assert resolve_auto_precision("auto", "bf16-mixed", frozenset({"bf16"})) == "32-true"
    assert resolve_auto_precision("auto", "16-mixed", frozenset({"bf16"})) == "16-mixed"
    assert resolve_auto_precision("bf16-mixed", "bf16-mixed", frozenset({"bf16"})) == "bf16-mixed"
    got = _by_name(decide_setup(dataclasses.replace(H100, precision="32-true"), frozenset({"bf16"})))
    assert str(got["bf16"]) == "bf16: off (refused: precision='auto' keeps 32-true)"
    measured = MeasuredFacts(step_s=0.003, steps_per_epoch=100_000, busy_share=0.4)
    for name in ("compile", "cuda_graphs"):
        got = _by_name(decide_measured(H100, measured, frozenset({name})))
        assert str(got[name]) == f"{name}: off (refused by name)"


def test_compile_when_it_pays_back_within_an_epoch() -> None:
    long_run = MeasuredFacts(step_s=0.041, steps_per_epoch=20_000, busy_share=0.98)
    got = _by_name(decide_measured(H100, long_run))
    assert got["compile"].on and "step 41.0 ms x 20000 steps/epoch" in got["compile"].reason
    assert "pays back in" in got["compile"].reason
    assert str(got["cuda_graphs"]) == "cuda_graphs: off (step 41.0 ms, launch-bound share 2%: graphs would save <2%)"
    short_run = MeasuredFacts(step_s=0.041, steps_per_epoch=100, busy_share=0.98)
    got = _by_name(decide_measured(H100, short_run))
    assert not got["compile"].on and "does not pay back within an epoch" in got["compile"].reason
    unknown = _by_name(decide_measured(H100, MeasuredFacts(0.041, None, 0.98)))
    assert not unknown["compile"].on and "run length unknown" in unknown["compile"].reason
    asked = _by_name(decide_measured(dataclasses.replace(H100, compile_asked=False), long_run))
    assert str(asked["compile"]) == "compile: off (as given: compile= of the Session or torch.compile(model))"
    cpu = _by_name(decide_measured(CPU, MeasuredFacts(0.5, 10**6, None)))
    assert not cpu["compile"].on and not cpu["cuda_graphs"].on


def test_cuda_graphs_only_when_the_step_is_launch_bound() -> None:
    # the GPU ran kernels 55% of a 3 ms step: 45% idle between launches
    bound = MeasuredFacts(step_s=0.003, steps_per_epoch=200_000, busy_share=0.55)
    got = _by_name(decide_measured(H100, bound))
    assert str(got["cuda_graphs"]).startswith("cuda_graphs: on (step 3.0 ms, launch-bound share 45%")
    busy = _by_name(decide_measured(H100, dataclasses.replace(bound, busy_share=0.996)))
    assert str(busy["cuda_graphs"]) == "cuda_graphs: off (step 3.0 ms, launch-bound share 0%: graphs would save <1%)"
    ddp = _by_name(decide_measured(dataclasses.replace(H100, strategy="ddp", layout=Layout(replicas=2)), bound))
    assert not ddp["cuda_graphs"].on and "collectives" in ddp["cuda_graphs"].reason
    not_measured = _by_name(decide_measured(H100, dataclasses.replace(bound, busy_share=None)))
    assert str(not_measured["cuda_graphs"]) == "cuda_graphs: off (launch-bound share not measured)"
    # a short run: the idle time saved does not pay back the compile
    few = dataclasses.replace(bound, steps_per_epoch=int(COMPILE_COST_S / (0.003 * 0.45)) - 1)
    assert not _by_name(decide_measured(H100, few))["cuda_graphs"].on


def test_bad_auto_and_refuse_values_name_the_allowed() -> None:
    assert check_auto(True, ("compile", "channels_last")) == (True, frozenset({"compile", "channels_last"}))
    assert check_auto(False, "tf32") == (False, frozenset({"tf32"}))
    with pytest.raises(ConfigurationError, match="auto='yes'; use True"):
        check_auto("yes", ())
    with pytest.raises(ConfigurationError, match="unknown setting.*'bogus'.*" + ", ".join(AUTO_SETTINGS)):
        gpukit.Session(accelerator="cpu", refuse=("bogus",), verbose=False)
    with pytest.raises(ConfigurationError, match="give a tuple of setting names"):
        check_auto(True, 3)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).flatten(2).transpose(1, 2)  # (batch, pixels, channels)
        h, _ = self.attn(h, h, h, need_weights=False)
        return self.head(h.mean(1))


class _GpuLike(CPUAccelerator):
    """CPU tensors, but the traits of an H100, and a kernel window that reports a launch-bound step."""

    is_host = False

    def __init__(self, busy_share: float = 0.5) -> None:
        self.calls: list[str] = []
        self.busy_share = busy_share

    def speed_traits(self, device: torch.device) -> SpeedTraits:
        return SpeedTraits(name="H100-like", capability=(9, 0), tf32=True, tensor_cores=True, cuda_graphs=True,
                           flash_attention=True)

    def enable_tf32(self) -> None:
        self.calls.append("tf32")

    def enable_attention_kernels(self) -> None:
        self.calls.append("attention")

    def kernel_window(self, device: torch.device) -> KernelWindow:
        outer = self

        class Window(KernelWindow):
            def start(self) -> None:
                outer.calls.append("start")

            def stop(self) -> tuple[float, float]:
                outer.calls.append("stop")
                return MEASURED_STEPS * 0.004, MEASURED_STEPS * 0.004 * outer.busy_share

        return Window()


def _auto(accelerator: CPUAccelerator, precision: str = "32-true", refused: frozenset[str] = frozenset(),
          steps: int | None = 1_000_000) -> tuple[SessionAuto, SingleDeviceStrategy]:
    strategy = SingleDeviceStrategy(accelerator, torch.device("cpu"))
    strategy.precision = get_precision(precision, accelerator, torch.device("cpu"))
    lines: list[str] = []
    auto = SessionAuto(True, refused, strategy, "auto", None, lambda: steps, lines.append)
    auto.lines = lines  # type: ignore[attr-defined]
    return auto, strategy


def test_settings_are_applied_and_the_maths_is_unchanged() -> None:
    torch.manual_seed(0)
    plain = _Net()
    model = copy.deepcopy(plain)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    accelerator = _GpuLike()
    auto, _ = _auto(accelerator)
    model = auto.before_wrap(model, optimizer, compiled=False)
    assert accelerator.calls == ["tf32", "attention"]
    assert all(g["fused"] for g in optimizer.param_groups) and optimizer.defaults["fused"]
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert {d.name for d in auto.decisions if d.on} == {"tf32", "fused_optimizer", "channels_last", "attention"}
    assert any(line.startswith("gpukit: auto: fused_optimizer: on (AdamW with fused=True") for line in auto.lines)
    # the same update as torch's default kernel and layout, up to float rounding (the NHWC convolution
    # sums in another order; Adam divides near-zero gradients by their own size): 3 steps of lr 1e-2
    # move a weight ~3e-2, the two runs differ by <1e-4
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    x = torch.randn(4, 3, 6, 6)
    for _ in range(3):
        for net, opt in ((plain, reference), (model, optimizer)):
            net(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(plain.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def test_refused_settings_are_not_applied() -> None:
    model, accelerator = _Net(), _GpuLike()
    optimizer = torch.optim.AdamW(model.parameters())
    auto, _ = _auto(accelerator, refused=frozenset({"fused_optimizer", "channels_last", "tf32", "attention"}))
    model = auto.before_wrap(model, optimizer, compiled=False)
    assert accelerator.calls == [] and not optimizer.defaults.get("fused")
    assert not model.conv.weight.is_contiguous(memory_format=torch.channels_last)


def test_measured_after_the_first_steps_then_compiled_in_place() -> None:
    accelerator = _GpuLike(busy_share=0.5)  # launch-bound: half of each step idle
    auto, _ = _auto(accelerator)
    model = auto.before_wrap(nn.Linear(4, 4), None, compiled=False)
    auto.after_setup(model)
    for _ in range(WARMUP_STEPS + MEASURED_STEPS + 5):
        auto.after_step()
    assert accelerator.calls.count("start") == 1 and accelerator.calls.count("stop") == 1  # one window, once
    got = _by_name(auto.decisions)
    assert got["compile"].on and got["cuda_graphs"].on
    assert "step 4.0 ms, launch-bound share 50%" in got["cuda_graphs"].reason
    assert model._compiled_call_impl is not None  # compiled in place: the module and its keys unchanged
    assert sorted(model.state_dict()) == ["bias", "weight"]
    # compile settled by the user: no profiling window, the decision says so
    accelerator = _GpuLike()
    strategy = SingleDeviceStrategy(accelerator, torch.device("cpu"))
    asked = SessionAuto(True, frozenset(), strategy, "auto", {"mode": "max-autotune"}, lambda: 10**6, None)
    asked.after_setup(asked.before_wrap(nn.Linear(4, 4), None, compiled=True))
    for _ in range(WARMUP_STEPS + MEASURED_STEPS):
        asked.after_step()
    assert "start" not in accelerator.calls
    assert str(_by_name(asked.decisions)["compile"]).startswith("compile: on (as given")


def test_a_cpu_session_decides_everything_off_and_says_so_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    session = gpukit.Session(accelerator="cpu", verbose=True)
    model = _Net()
    model, optimizer = session.setup(model, torch.optim.AdamW(model.parameters()))
    err = capsys.readouterr().err
    assert "gpukit: auto: every automatic setting is off on the CPU (session.auto_settings says why)" in err
    assert {d.name for d in session.auto_settings} == {"bf16", "tf32", "fused_optimizer", "channels_last", "attention"}
    x = torch.randn(2, 3, 4, 4)
    for _ in range(WARMUP_STEPS + MEASURED_STEPS):
        session.backward(model(x).square().mean())
        session.step(optimizer)
    measured = _by_name(session.auto_settings)
    assert not measured["compile"].on and measured["compile"].reason.startswith("the CPU")
    assert not any(d.on for d in session.auto_settings)
    assert "gpukit: auto" not in capsys.readouterr().err  # said once, at setup
    off = gpukit.Session(accelerator="cpu", verbose=False, auto=False)
    off.setup(_Net())
    assert off.auto_settings == []


def test_model_and_optimizer_facts() -> None:
    assert model_facts(_Net()) == {"conv2d_layers": 1, "attention_layers": 1}

    class Sdpa(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return nn.functional.scaled_dot_product_attention(q, q, q)

    assert model_facts(nn.Sequential(Sdpa(), Sdpa()))["attention_layers"] == 2
    params = list(nn.Linear(2, 2).parameters())
    assert optimizer_facts(torch.optim.AdamW(params)) == {"optimizer": "AdamW", "optimizer_kernel": None, "param_tensors": 2}
    assert optimizer_facts(torch.optim.AdamW(params, foreach=False))["optimizer_kernel"] == "for-loop"
    assert optimizer_facts(torch.optim.SGD(params, lr=0.1, fused=True))["optimizer_kernel"] == "fused"


@pytest.mark.requires_gpu
def test_the_kernel_window_measures_a_launch_bound_and_a_busy_step_on_cuda() -> None:
    device = torch.device("cuda", 0)
    accelerator = get_accelerator(device)
    small, big = torch.randn(8, 8, device=device), torch.randn(4096, 4096, device=device)
    shares = {}
    for name, x, ops in (("tiny", small, 400), ("matmul", big, 8)):
        window = accelerator.kernel_window(device)
        window.start()
        for _ in range(ops):
            x = torch.tanh(x @ x) if name == "tiny" else (x @ x) / 4096
        wall_s, busy_s = window.stop()
        assert 0 < busy_s <= wall_s
        shares[name] = busy_s / wall_s
    assert shares["tiny"] < 0.5 < shares["matmul"]  # tiny kernels leave the GPU idle between launches
    traits = accelerator.speed_traits(device)
    assert traits.capability is not None and traits.cuda_graphs and traits.name


@pytest.mark.requires_gpu
def test_a_cuda_session_applies_the_setup_settings_and_measures_the_window() -> None:
    session = gpukit.Session(devices=1, verbose=False)
    torch.manual_seed(0)
    model = _Net()
    model, optimizer = session.setup(model, torch.optim.AdamW(model.parameters()))
    got = _by_name(session.auto_settings)
    assert got["fused_optimizer"].on and all(g["fused"] for g in optimizer.param_groups)
    assert got["channels_last"].on == model.conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert got["tf32"].on == (torch.cuda.get_device_capability()[0] >= 8 and session.precision.name != "32-true")
    x = torch.randn(8, 3, 8, 8, device=session.device)
    for _ in range(WARMUP_STEPS + MEASURED_STEPS):
        session.backward(model(x).square().mean())
        session.step(optimizer)
    graphs = _by_name(session.auto_settings)["cuda_graphs"]
    # a tiny convnet leaves the GPU idle between launches; without a loader the run length is unknown
    assert "launch-bound share" in graphs.reason and not graphs.on, graphs
    assert not _by_name(session.auto_settings)["compile"].on


class _OldGpu(CPUAccelerator):
    """What a T4 / V100 answers about precision (no native bf16: "auto" is 16-mixed there)."""

    def supports_bf16(self, device: torch.device | None = None) -> bool:
        return False

    def auto_precision(self, device: torch.device | None = None) -> str:
        return "16-mixed"


class _Ampere(CPUAccelerator):
    def auto_precision(self, device: torch.device | None = None) -> str:
        return "bf16-mixed"


def test_auto_precision_is_never_one_the_strategy_refuses() -> None:
    """On a GPU without bf16, "auto" was 16-mixed whatever the strategy, and FSDP (the default settings
    on a 2x T4 machine with strategy="fsdp") then refused it at setup: the user had asked for nothing."""
    from gpukit.strategies import FSDPStrategy

    assert FSDPStrategy.loss_scaling is False and SingleDeviceStrategy.loss_scaling is True
    cpu, old = torch.device("cpu"), _OldGpu()
    for enabled in (True, False):
        assert SessionAuto.precision_name("auto", enabled, frozenset(), old, cpu, loss_scaling=False) == "32-true"
        assert SessionAuto.precision_name("Auto", enabled, frozenset(), old, cpu, loss_scaling=False) == "32-true"
        assert SessionAuto.precision_name("auto", enabled, frozenset(), old, cpu) == "16-mixed"
        # asked for by name: kept (FSDP refuses it at setup with its reason)
        assert SessionAuto.precision_name("16-mixed", enabled, frozenset(), old, cpu, loss_scaling=False) == "16-mixed"
    # where bf16 is native, FSDP keeps bf16-mixed; refused by name (auto on), 32-true as before
    ampere = _Ampere()
    assert SessionAuto.precision_name("auto", True, frozenset(), ampere, cpu, loss_scaling=False) == "bf16-mixed"
    assert SessionAuto.precision_name("auto", True, frozenset({"bf16"}), ampere, cpu) == "32-true"
    assert SessionAuto.precision_name("auto", False, frozenset({"bf16"}), ampere, cpu) == "bf16-mixed"
