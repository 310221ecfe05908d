"""The automatic settings a GPU rewards, decided from facts: a pure function, no torch, no device.

``Session(auto=True)`` (the default) turns on what the device and model reward and prints each
setting once, with the reason it was chosen or left off; ``refuse=("compile", ...)`` keeps a
setting off by name. The facts (device traits, model structure, optimizer, measured step and busy
times) are gathered by ``_auto.py``; here they only become decisions, so CPU tests can feed
GPU-like facts and check every decision and its printed reason.

None of them changes the maths beyond the chosen precision: bf16 is the precision ``"auto"``
picks, TF32 only where gpukit picks the precision (never under an explicit ``"32-true"``), a
fused optimizer runs the same update in one kernel, channels_last and the attention kernels
change the memory layout and kernel, compile and CUDA graphs run the same graph faster.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpukit.errors import ConfigurationError
from gpukit.layout import Layout

__all__ = [
    "AUTO_SETTINGS", "COMPILE_COST_S", "COMPILE_SAVING", "Decision", "GRAPHS_MIN_IDLE_SHARE", "MeasuredFacts",
    "SetupFacts", "check_auto", "decide_measured", "decide_setup", "resolve_auto_precision",
]

#: every setting, by the name ``refuse=`` takes
AUTO_SETTINGS = ("bf16", "tf32", "fused_optimizer", "channels_last", "attention", "compile", "cuda_graphs")

#: what a first torch.compile of a training step costs, seconds: dynamo + inductor for a model of tens
#: to hundreds of layers takes ~20-90 s on one GPU (torch's compile-time tutorial); the middle
COMPILE_COST_S = 60.0
#: share of eager step time inductor saves on a training step (torch's published training speed-ups
#: over eager, 1.3-1.5x geometric mean, give 23-33%; the low side, as a step may graph-break)
COMPILE_SAVING = 0.2
#: CUDA graphs pay when the GPU idles at least this share of a step between kernels (launch-bound)
GRAPHS_MIN_IDLE_SHARE = 0.25
#: the optimizers torch has a fused kernel for (``fused=True``)
FUSED_OPTIMIZERS = ("Adam", "AdamW", "SGD")


def _plain_params(f: SetupFacts) -> bool:
    """Parameters that are plain tensors on one device (FSDP's are DTensor shards, at any degree; tensor
    parallelism's DTensor pieces; a split model's sit on several devices): where a fused optimizer and
    channels_last go."""
    layout = f.layout
    return f.plain_parameters and layout.shards == 1 and layout.tensor == 1 and layout.stages == 1


def _compiles(layout: Layout) -> bool:
    """Whether ``torch.compile`` applies: not a DataParallel's per-step replicas, a split model or DTensor pieces."""
    return layout.stages == 1 and layout.tensor == 1 and not (layout.one_process and layout.replicas > 1)


@dataclass(frozen=True)
class SetupFacts:
    """What is known at ``session.setup``: the device, the precision, the model and the optimizer.

    Attributes:
        device: the device's name ("NVIDIA H100 80GB HBM3", "cpu").
        host: the device is the host CPU.
        capability: CUDA compute capability, ``None`` off CUDA.
        tf32: the device has TF32 tensor cores (Ampere+).
        tensor_cores: the device has fp16/bf16 tensor cores (Volta+).
        cuda_graphs: the device can capture CUDA graphs.
        flash_attention: the device runs the flash attention kernel (Ampere+).
        precision_asked: ``Session(precision=...)`` as given ("auto" or a name).
        precision: the precision it resolved to.
        strategy: the strategy's name (for the reasons).
        layout: how the strategy divides the work (what the decisions read).
        plain_parameters: the strategy keeps parameters as plain tensors (``Strategy.plain_parameters``).
        conv2d_layers: ``nn.Conv2d`` layers in the model.
        attention_layers: attention layers (``nn.MultiheadAttention`` or a forward calling
            ``scaled_dot_product_attention``).
        optimizer: the optimizer's class name, ``None`` without one.
        optimizer_kernel: what the user set on it: "fused", "foreach", or ``None`` (torch's default).
        param_tensors: parameter tensors the optimizer steps.
        compile_asked: ``Session(compile=...)``: True (given), False (``compile=False``), ``None`` (open).
        compile_mode: the mode asked for (``"reduce-overhead"`` is CUDA graphs), ``None`` if none.
    """

    device: str
    host: bool
    capability: tuple[int, int] | None
    tf32: bool
    tensor_cores: bool
    cuda_graphs: bool
    flash_attention: bool
    precision_asked: str
    precision: str
    strategy: str
    layout: Layout = Layout()
    plain_parameters: bool = True
    conv2d_layers: int = 0
    attention_layers: int = 0
    optimizer: str | None = None
    optimizer_kernel: str | None = None
    param_tensors: int = 0
    compile_asked: bool | None = None
    compile_mode: str | None = None

    @property
    def gpu(self) -> str:
        """The device in a reason: "NVIDIA H100 80GB HBM3 [sm_90]" or "the CPU"."""
        if self.host:
            return "the CPU"
        return f"{self.device} [sm_{self.capability[0]}{self.capability[1]}]" if self.capability else self.device


@dataclass(frozen=True)
class MeasuredFacts:
    """What the first steps measured.

    Attributes:
        step_s: median wall time of a steady step.
        steps_per_epoch: the loader's length, ``None`` when unknown.
        busy_share: share of the measured steps' wall time the device ran kernels (``None``: not measured).
    """

    step_s: float
    steps_per_epoch: int | None
    busy_share: float | None


@dataclass(frozen=True)
class Decision:
    """One setting: on or off, and why (printed as ``"tf32: on (...)"``)."""

    name: str
    on: bool
    reason: str

    def __str__(self) -> str:
        return f"{self.name}: {'on' if self.on else 'off'} ({self.reason})"


def check_auto(auto: object, refuse: object) -> tuple[bool, frozenset[str]]:
    """``Session(auto=..., refuse=...)`` checked: whether automatic settings are on, and the refused names.

    Raises:
        ConfigurationError: ``auto`` not a bool, or a name in ``refuse`` that is not a setting.
    """
    if not isinstance(auto, bool):
        raise ConfigurationError(f"auto={auto!r}; use True (the settings a GPU rewards, each printed with its "
                                 f"reason) or False (none), and refuse=(...) to keep single ones off.")
    names = (refuse,) if isinstance(refuse, str) else refuse
    try:
        given = [str(n) for n in names]  # type: ignore[union-attr]
    except TypeError:
        raise ConfigurationError(f"refuse={refuse!r}; give a tuple of setting names: {', '.join(AUTO_SETTINGS)}.") from None
    unknown = sorted(set(given) - set(AUTO_SETTINGS))
    if unknown:
        raise ConfigurationError(f"refuse={refuse!r}: unknown setting(s) {', '.join(map(repr, unknown))}; the "
                                 f"automatic settings are {', '.join(AUTO_SETTINGS)} (e.g. refuse=('compile',)).")
    return auto, frozenset(given)


def resolve_auto_precision(asked: str, auto_choice: str, refused: frozenset[str]) -> str:
    """What ``precision="auto"`` becomes: the accelerator's ``auto_choice``, or "32-true" when that is a
    bf16 precision and "bf16" is refused. Any other ``asked`` is returned as it is."""
    if asked != "auto":
        return asked
    return "32-true" if auto_choice.startswith("bf16") and "bf16" in refused else auto_choice


def _refused(name: str, refused: frozenset[str]) -> Decision | None:
    return Decision(name, False, "refused by name") if name in refused else None


def decide_setup(facts: SetupFacts, refused: frozenset[str] = frozenset()) -> list[Decision]:
    """The settings decided at ``session.setup``: bf16, tf32, fused_optimizer, channels_last, attention."""
    return [_bf16(facts, refused), _tf32(facts, refused), _fused(facts, refused), _channels_last(facts, refused),
            _attention(facts, refused)]


def _bf16(f: SetupFacts, refused: frozenset[str]) -> Decision:
    low = f.precision.startswith("bf16")
    if f.precision_asked != "auto":
        return Decision("bf16", low, f"precision={f.precision_asked!r} as asked")
    if "bf16" in refused and not low:
        return Decision("bf16", False, "refused: precision='auto' keeps 32-true")
    if low and f.host:  # "auto" is 32-true on the CPU: only Session(fit=...) makes it 16 bits there
        return Decision("bf16", True, f"precision='auto' on the CPU: {f.precision}, chosen by fit to fit the budget")
    if low:
        return Decision("bf16", True, f"precision='auto' on {f.gpu} with native bf16: {f.precision}, tensor "
                                      "cores at 2x+ the fp32 rate, no loss scaling")
    if f.host:
        return Decision("bf16", False, "the CPU: precision='auto' keeps 32-true; bf16 autocast rarely pays there")
    return Decision("bf16", False, f"{f.gpu} has no native bf16: precision='auto' is {f.precision}")


def _tf32(f: SetupFacts, refused: frozenset[str]) -> Decision:
    if (no := _refused("tf32", refused)) is not None:
        return no
    if not f.tf32:
        return Decision("tf32", False, f"{f.gpu}: TF32 tensor cores need an Ampere+ GPU")
    if f.precision_asked == "32-true":
        return Decision("tf32", False, "precision='32-true' asked for: fp32 matmuls kept at full precision")
    if f.precision.endswith("-true") and f.precision != "32-true":
        return Decision("tf32", False, f"{f.precision}: no fp32 matmuls to speed up")
    return Decision("tf32", True, f"{'fp32 matmuls outside autocast' if f.precision.endswith('-mixed') else 'all fp32 matmuls'} "
                                  f"on TF32 tensor cores of {f.gpu}: ~7-8x the fp32 rate, A100 156 vs 19.5 TFLOP/s")


def _fused(f: SetupFacts, refused: frozenset[str]) -> Decision:
    if (no := _refused("fused_optimizer", refused)) is not None:
        return no
    if f.optimizer is None:
        return Decision("fused_optimizer", False, "no optimizer given to setup")
    if f.host:
        return Decision("fused_optimizer", False, "the CPU: torch's default kept, no kernel launches to save")
    if f.optimizer_kernel is not None:
        return Decision("fused_optimizer", f.optimizer_kernel == "fused", f"{f.optimizer_kernel} kernel set on the optimizer: kept")
    if f.optimizer not in FUSED_OPTIMIZERS:
        return Decision("fused_optimizer", False, f"{f.optimizer} has no fused kernel; torch has one for {', '.join(FUSED_OPTIMIZERS)}")
    if not _plain_params(f):
        return Decision("fused_optimizer", False, f"strategy {f.strategy!r}: its parameters are not plain tensors on one device")
    return Decision("fused_optimizer", True, f"{f.optimizer} with fused=True: one kernel per step over {f.param_tensors} "
                                             "parameter tensors instead of a launch per op and tensor group")


def _channels_last(f: SetupFacts, refused: frozenset[str]) -> Decision:
    if (no := _refused("channels_last", refused)) is not None:
        return no
    if f.conv2d_layers == 0:
        return Decision("channels_last", False, "no Conv2d")
    if f.host or not f.tensor_cores:
        return Decision("channels_last", False, f"{f.gpu}: no tensor cores, NCHW is as fast")
    if f.precision == "32-true" and not (f.tf32 and f.precision_asked != "32-true"):
        return Decision("channels_last", False, "fp32 convolutions without TF32: no tensor cores to feed")
    if not _plain_params(f):
        return Decision("channels_last", False, f"strategy {f.strategy!r} shards or splits the weights: layout kept")
    return Decision("channels_last", True, f"{f.conv2d_layers} Conv2d layer(s) on tensor cores: cuDNN's NHWC kernels "
                                           "skip the layout transposes; NVIDIA: ~1.2x on ResNet-50 in AMP")


def _attention(f: SetupFacts, refused: frozenset[str]) -> Decision:
    if (no := _refused("attention", refused)) is not None:
        return no
    if f.attention_layers == 0:
        return Decision("attention", False, "no attention layer: no nn.MultiheadAttention, no scaled_dot_product_attention call")
    if f.host:
        return Decision("attention", False, "the CPU: torch picks its CPU kernel")
    if not f.flash_attention or f.precision == "32-true":
        why = "fp32: flash needs bf16/fp16" if f.precision == "32-true" else f"{f.gpu}: flash needs Ampere+"
        return Decision("attention", True, f"{f.attention_layers} attention layer(s): memory-efficient kernel; {why}")
    return Decision("attention", True, f"{f.attention_layers} attention layer(s): flash and memory-efficient SDPA "
                                       f"kernels enabled under {f.precision}: O(sequence) memory, not O(sequence^2)")


def decide_measured(facts: SetupFacts, measured: MeasuredFacts, refused: frozenset[str] = frozenset()) -> list[Decision]:
    """The settings decided after the first steps: compile (does it pay back?) and CUDA graphs (is the
    step launch-bound?). CUDA graphs are torch.compile's ``mode="reduce-overhead"``, so they need compile."""
    return [_compile(facts, measured, refused), _graphs(facts, measured, refused)]


def _compile(f: SetupFacts, m: MeasuredFacts, refused: frozenset[str]) -> Decision:
    if f.compile_asked is not None:
        return Decision("compile", f.compile_asked, "as given: compile= of the Session or torch.compile(model)")
    if (no := _refused("compile", refused)) is not None:
        return no
    if f.host:
        return Decision("compile", False, "the CPU: inductor's C++ build rarely pays back there")
    if not _compiles(f.layout):
        return Decision("compile", False, f"strategy {f.strategy!r} cannot compile")
    step_ms = m.step_s * 1e3
    if m.steps_per_epoch is None:
        return Decision("compile", False, f"step {step_ms:.1f} ms, run length unknown without a gpukit loader; "
                                          "Session(compile=True) compiles anyway")
    saved_s = m.step_s * COMPILE_SAVING * m.steps_per_epoch
    head = (f"step {step_ms:.1f} ms x {m.steps_per_epoch} steps/epoch: ~{COMPILE_SAVING:.0%} saves {saved_s:.0f} s "
            f"per epoch against ~{COMPILE_COST_S:.0f} s of compiling")
    if saved_s < COMPILE_COST_S:
        return Decision("compile", False, f"{head}: does not pay back within an epoch")
    return Decision("compile", True, f"{head}: pays back in {COMPILE_COST_S / saved_s:.1f} epoch(s)")


def _graphs(f: SetupFacts, m: MeasuredFacts, refused: frozenset[str]) -> Decision:
    if f.compile_mode == "reduce-overhead":
        return Decision("cuda_graphs", True, "as given: compile mode='reduce-overhead'")
    if (no := _refused("cuda_graphs", refused)) is not None:
        return no
    if not f.cuda_graphs:
        return Decision("cuda_graphs", False, f"{f.gpu}: no CUDA graphs")
    if m.busy_share is None:
        return Decision("cuda_graphs", False, "launch-bound share not measured")
    idle = max(0.0, 1.0 - m.busy_share)
    head = f"step {m.step_s * 1e3:.1f} ms, launch-bound share {idle:.0%}"
    if idle < GRAPHS_MIN_IDLE_SHARE:
        saves = "<1%" if idle < 0.01 else f"<{idle:.0%}"
        return Decision("cuda_graphs", False, f"{head}: graphs would save {saves}")
    if f.strategy != "single":
        return Decision("cuda_graphs", False, f"{head}, but strategy {f.strategy!r}: collectives are not captured "
                                              "by gpukit; Session(compile={'mode': 'reduce-overhead'}) to try")
    if f.compile_asked is not None or "compile" in refused:
        return Decision("cuda_graphs", False, f"{head}, but graphs come with compile mode='reduce-overhead', and "
                                              "compile was set or refused")
    if m.steps_per_epoch is None or m.step_s * idle * m.steps_per_epoch < COMPILE_COST_S:
        return Decision("cuda_graphs", False, f"{head}: saving it would not pay back ~{COMPILE_COST_S:.0f} s of "
                                              "compiling within an epoch")
    return Decision("cuda_graphs", True, f"{head}: graphs, compile mode='reduce-overhead', save up to ~{idle:.0%}")
