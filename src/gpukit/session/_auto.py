"""The automatic settings in a Session: gather the facts, apply what ``_auto_decide`` decides, say why.

Two moments:

- at ``session.setup`` (before the strategy wraps the model): bf16 (already chosen with the
  precision), TF32, a fused optimizer, channels_last, the attention kernels;
- after the first steps (``session.step`` calls ``after_step``): ``WARMUP_STEPS`` steps are let
  pass (cuDNN autotuning, the allocator warming up), then ``MEASURED_STEPS`` are timed in one
  :class:`~gpukit.accelerators.KernelWindow` (wall time, and on a GPU the time its kernels ran: the
  rest is the GPU idle between kernels, i.e. launch-bound); compile and CUDA graphs are decided from
  that, rank 0's measurement for every rank, and compile is applied in place.

Each decision is printed once on rank 0 when the session is verbose (on the CPU, where they are all
off, one line says so); ``session.auto_settings`` lists them all with their reasons.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gpukit.accelerators import Accelerator, KernelWindow
from gpukit.session._auto_decide import (
    Decision, MeasuredFacts, SetupFacts, decide_measured, decide_setup, resolve_auto_precision,
)
from gpukit.session._loaders import LoaderTracker
from gpukit.strategies import CompileRequest, Strategy, compile_module

__all__ = ["MEASURED_STEPS", "SessionAuto", "WARMUP_STEPS", "loader_steps", "model_facts", "optimizer_facts",
           "say_on", "use_fused"]

#: steps let pass before measuring (first-step autotuning and allocation are not the steady step)
WARMUP_STEPS = 5
#: steps measured in one window
MEASURED_STEPS = 10


def model_facts(model: nn.Module) -> dict[str, int]:
    """Conv2d and attention layers in ``model`` (an attention layer: ``nn.MultiheadAttention``, or a
    module whose ``forward`` calls ``scaled_dot_product_attention``)."""
    convs = attention = 0
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            convs += 1
        elif isinstance(module, nn.MultiheadAttention):
            attention += 1
        else:
            code = getattr(type(module).forward, "__code__", None)
            attention += bool(code is not None and "scaled_dot_product_attention" in code.co_names)
    return {"conv2d_layers": convs, "attention_layers": attention}


def optimizer_facts(optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The optimizer's class, the kernel the user set on it ("fused", "foreach", "for-loop" or
    ``None`` for torch's default) and how many parameter tensors it steps."""
    if optimizer is None:
        return {"optimizer": None, "optimizer_kernel": None, "param_tensors": 0}
    defaults = getattr(optimizer, "defaults", {})
    kernel = ("fused" if defaults.get("fused") else "foreach" if defaults.get("foreach")
              else "for-loop" if defaults.get("foreach") is False else None)
    tensors = sum(len(group["params"]) for group in optimizer.param_groups)
    return {"optimizer": type(optimizer).__name__, "optimizer_kernel": kernel, "param_tensors": tensors}


class SessionAuto:
    """``Session(auto=..., refuse=...)``: the automatic settings of one session.

    Args:
        enabled: ``auto=``; False decides and applies nothing.
        refused: the setting names in ``refuse=``.
        strategy: the session's strategy (its precision, device, rank; it compiles the model).
        precision_asked: ``Session(precision=...)`` as given.
        compile_setting: ``Session(compile=...)`` as given (``None``: left open, ``False``: refused).
        steps_per_epoch: the length of the loader in use, ``None`` when unknown.
        say: prints one line (rank 0, verbose); ``None`` says nothing.
    """

    def __init__(self, enabled: bool, refused: frozenset[str], strategy: Strategy, precision_asked: Any,
                 compile_setting: Any, steps_per_epoch: Callable[[], int | None],
                 say: Callable[[str], None] | None) -> None:
        self.enabled = enabled
        self.refused = refused
        self._strategy = strategy
        self._precision_asked = precision_asked if isinstance(precision_asked, str) else "given"
        self._compile_setting = compile_setting
        self._steps_per_epoch = steps_per_epoch
        self._say = say
        #: every decision so far, setup's then the measured ones
        self.decisions: list[Decision] = []
        self._facts: SetupFacts | None = None
        self._model: nn.Module | None = None
        self._calls = 0
        self._window: KernelWindow | None = None
        self._window_start_s = 0.0

    @property
    def _accelerator(self) -> Accelerator:
        return self._strategy.accelerator

    @staticmethod
    def precision_name(precision: Any, enabled: bool, refused: frozenset[str], accelerator: Accelerator,
                       device: torch.device, *, loss_scaling: bool = True) -> Any:
        """``Session(precision=...)`` with "auto" resolved here: 32-true instead of bf16 when "bf16" is
        refused (and automatic settings are on), and instead of 16-mixed (a GPU without native bf16) where
        the strategy cannot scale losses (``loss_scaling=False``: FSDP, which refuses a GradScaler) --
        the default precision must not be one the strategy refuses. Any other value is returned unchanged."""
        if not isinstance(precision, str) or precision.strip().lower() != "auto":
            return precision
        choice = resolve_auto_precision("auto", accelerator.auto_precision(device), refused if enabled else frozenset())
        return "32-true" if choice == "16-mixed" and not loss_scaling else choice

    # -- at setup --------------------------------------------------------------------------------
    def before_wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, compiled: bool) -> nn.Module:
        """Decide and apply the set-up settings on the plain ``model`` (before the strategy wraps it).

        Args:
            model: the converted, unwrapped model.
            optimizer: the optimizer given to setup, if any.
            compiled: whether setup compiles the model (``Session(compile=...)`` or ``torch.compile(model)``).
        """
        if not self.enabled:
            return model
        traits = self._accelerator.speed_traits(self._strategy.root_device)
        precision = self._strategy.precision.name
        asked = self._precision_asked if self._precision_asked != "given" else precision
        setting = self._compile_setting
        options = setting if isinstance(setting, dict) else {}
        self._facts = SetupFacts(
            device=traits.name, host=self._accelerator.is_host, capability=traits.capability, tf32=traits.tf32,
            tensor_cores=traits.tensor_cores, cuda_graphs=traits.cuda_graphs, flash_attention=traits.flash_attention,
            precision_asked=asked, precision=precision, strategy=self._strategy.name, layout=self._strategy.layout,
            plain_parameters=self._strategy.plain_parameters,
            compile_asked=True if compiled or setting not in (None, False) else (False if setting is False else None),
            compile_mode=options.get("mode"), **model_facts(model), **optimizer_facts(optimizer),
        )
        decisions = decide_setup(self._facts, self.refused)
        on = {d.name for d in decisions if d.on}
        if "tf32" in on:
            self._accelerator.enable_tf32()
        if "attention" in on:
            self._accelerator.enable_attention_kernels()
        if "channels_last" in on:
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        if "fused_optimizer" in on and optimizer is not None and self._facts.optimizer_kernel is None:
            use_fused(optimizer)
        self._tell(decisions)
        return model

    def after_setup(self, model: nn.Module) -> None:
        """Keep the set-up model: compile is applied to it after the first steps."""
        self._model = model

    # -- after the first steps ---------------------------------------------------------------------
    def after_step(self) -> None:
        """Count one ``session.step``; open the measuring window after the warm-up, decide at its end."""
        if self._facts is None or self._model is None:
            return
        self._calls += 1
        if self._calls == WARMUP_STEPS:
            # profile the kernels only when a decision depends on it (the profiler costs those steps)
            settled = self._facts.compile_asked is not None or {"compile", "cuda_graphs"} <= self.refused
            self._window = KernelWindow() if settled else self._accelerator.kernel_window(self._strategy.root_device)
            self._window.start()
            self._window_start_s = time.perf_counter()
        elif self._calls == WARMUP_STEPS + MEASURED_STEPS and self._window is not None:
            timed = self._window.stop()  # on a GPU: after its queued work is done
            cpu_wall_s = time.perf_counter() - self._window_start_s
            self._window = None
            wall_s, busy = (timed[0], timed[1] / timed[0] if timed[0] > 0 else None) if timed else (cpu_wall_s, None)
            measured = MeasuredFacts(step_s=wall_s / MEASURED_STEPS, steps_per_epoch=self._steps_per_epoch(),
                                     busy_share=busy)
            if self._strategy.world_size > 1 and not self._facts.host:
                # rank 0's measurement for all: every rank compiles alike (one collective, once; on the
                # CPU, where both settings are off whatever the times, none)
                measured = self._strategy.broadcast(measured, 0)
            self.decide_after_steps(measured)

    def decide_after_steps(self, measured: MeasuredFacts) -> list[Decision]:
        """Decide compile and CUDA graphs from ``measured`` and apply them to the set-up model."""
        if self._facts is None or self._model is None:
            return []
        decisions = decide_measured(self._facts, measured, self.refused)
        on = {d.name for d in decisions if d.on}
        if self._facts.compile_asked is None and on & {"compile", "cuda_graphs"}:
            options = {"mode": "reduce-overhead"} if "cuda_graphs" in on else {}
            compile_module(self._strategy, self._model, CompileRequest(options=options, source="Session(auto=True)"))
        self._tell(decisions)
        return decisions

    def _tell(self, decisions: list[Decision]) -> None:
        self.decisions.extend(decisions)
        if self._say is None:
            return
        if self._facts is not None and self._facts.host and not any(d.on for d in decisions):
            if decisions[0].name == "bf16":  # at setup: one line for all; the measured ones stay quiet
                self._say("gpukit: auto: every automatic setting is off on the CPU (session.auto_settings says why)")
            return
        for decision in decisions:
            self._say(f"gpukit: auto: {decision}")


def use_fused(optimizer: torch.optim.Optimizer) -> None:
    """Switch ``optimizer`` (Adam, AdamW, SGD) to torch's fused kernel: the same update, one launch.

    ``fused`` is read from each parameter group at every ``step`` (and from ``defaults`` for groups
    added later); the GradScaler still unscales the gradients itself first (the optimizer does not
    claim ``_step_supports_amp_scaling``), so 16-mixed steps as before.
    """
    optimizer.defaults["fused"] = True
    for group in optimizer.param_groups:
        group["fused"] = True
        if group.get("foreach"):
            group["foreach"] = False  # torch refuses fused and foreach both set


def loader_steps(tracker: LoaderTracker) -> Callable[[], int | None]:
    """Steps per epoch: the length of the gpukit loader whose batch is in hand (``None``: none, or no length)."""
    def steps() -> int | None:
        loader = tracker.current
        try:
            return len(loader) if loader is not None else None
        except TypeError:  # an iterable dataset
            return None

    return steps


def say_on(stream: Any = None) -> Callable[[str], None]:
    """A ``say`` that prints to ``stream`` (stderr by default), flushed."""
    def say(line: str) -> None:
        print(line, file=stream or sys.stderr, flush=True)

    return say
