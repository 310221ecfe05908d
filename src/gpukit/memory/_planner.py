"""Predict the peak memory of a training step without touching the GPU.

The model's parameters, buffers and an example batch are recreated as *fake* tensors
(``FakeTensorMode``: shapes and dtypes, no memory), and a training step -- forward,
backward, optimizer step, zero_grad -- runs with the fake mode counting the bytes of every
storage an operator creates and subtracting them when the storage is freed (a weak-reference
callback; ``_simulate.py``). The high-water mark is the predicted peak; CUDA sizes are rounded up
to the allocator's 512-byte blocks. The steady state -- the next forward and backward with the
optimizer state now held -- is the first step's forward-and-backward peak on top of what the
step leaves live: simulating that second step gave the same figures in all 120 configurations
checked (4 models x 3 precisions x checkpointing x 5 optimizers, CPU and CUDA) at twice the
time; ``tests/memory/test_memory_planner.py`` keeps checking it. A model with a long run of alike
blocks (a transformer's layers) is simulated with that run cut to 2 and 3 units and every figure
extended to the whole run (``_repeat.py``): the same figures, in a fraction of the time.

Not modelled: library workspaces (cuBLAS/cuDNN scratch), the CUDA context itself (it is not
in ``torch.cuda.memory_allocated`` either) and allocator fragmentation (``reserved`` > ``allocated``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from gpukit._util.units import format_bytes
from gpukit.accelerators import get_accelerator
from gpukit.errors import ConfigurationError, MemoryPlanError
from gpukit.memory._activation import check_policy, checkpoint_targets, policy_name
from gpukit.memory._fake_optimizer import OPTIMIZERS, STATE_PER_PARAM, as_on_device, optimizer_class
from gpukit.memory._repeat import extend, find_run, reduced, segments
from gpukit.memory._simulate import StepSpec, simulate_step
from gpukit.precision import PRECISIONS, get_precision

__all__ = ["MemoryEstimate", "estimate_memory", "OPTIMIZERS"]

_CUDA_BLOCK = 512


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted memory of one training step, in bytes.

    Attributes:
        peak_bytes: predicted high-water mark of allocated memory during a step
            (compare with ``torch.cuda.max_memory_allocated()``).
        parameters_bytes, buffers_bytes, inputs_bytes: what the model and batch hold.
        gradients_bytes: one gradient per trainable parameter.
        optimizer_state_bytes: state after the first step (Adam: two tensors per parameter).
        activations_bytes: peak of forward+backward above what was live before the forward,
            less the gradients: saved activations and temporaries.
        notes: approximations made (e.g. optimizer state computed by formula).
        activation_checkpointing: the policy planned for ("none", "full", "selective", "custom").
        flops: floating-point operations of one forward+backward (checkpointing's recompute
            included), as ``torch.utils.flop_counter`` counts them (matmuls, convolutions, attention).
    """

    peak_bytes: int
    parameters_bytes: int
    buffers_bytes: int
    inputs_bytes: int
    gradients_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int
    precision: str
    device: str
    notes: tuple[str, ...] = field(default_factory=tuple)
    activation_checkpointing: str = "none"
    flops: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        rows = [
            ("parameters", self.parameters_bytes),
            ("buffers", self.buffers_bytes),
            ("inputs", self.inputs_bytes),
            ("gradients", self.gradients_bytes),
            ("optimizer state", self.optimizer_state_bytes),
            ("activations (peak)", self.activations_bytes),
            ("peak", self.peak_bytes),
        ]
        checkpointing = f", activation checkpointing {self.activation_checkpointing}" if self.activation_checkpointing != "none" else ""
        lines = [f"estimated training memory ({self.precision} on {self.device}{checkpointing})"]
        lines += [f"  {name:<20}{format_bytes(value):>12}" for name, value in rows]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


#: device types a plan can be made for (gpukit's accelerators)
_PLANNABLE_DEVICE_TYPES = ("cuda", "cpu", "mps")


def _planned_device(device: str | torch.device) -> torch.device:
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        target = None
    if target is None or target.type not in _PLANNABLE_DEVICE_TYPES:
        raise ConfigurationError(
            f"estimate_memory(device={device!r}): unsupported device; use one of "
            f"{', '.join(map(repr, _PLANNABLE_DEVICE_TYPES))}, optionally with an index "
            "such as 'cuda:1'."
        )
    return target


def estimate_memory(
    model: torch.nn.Module,
    optimizer: Any = "adam",
    example_batch: Any = None,
    *,
    precision: str = "32-true",
    device: str | torch.device = "cuda",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    activation_checkpointing: Any = None,
) -> MemoryEstimate:
    """Predict peak training memory of ``model`` on ``device`` without allocating there.

    Args:
        model: the model (anywhere: CPU, meta or GPU; it is not modified or copied).
        optimizer: an optimizer instance or class, ``"adam"``, ``"adamw"``, ``"sgd"``, or
            ``None``/``"none"`` for forward+backward only.
        example_batch: the model's input: a tensor (``model(x)``), a tuple/list
            (``model(*batch)``) or a dict (``model(**batch)``); only shapes and dtypes are used.
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``, ``"16-true"``.
        device: the device to plan for (``"cuda"`` by default; no GPU is needed).
        loss_fn: ``loss_fn(output) -> scalar``; by default the model's own ``output.loss``
            (Hugging Face models given ``labels``), else the mean of the outputs.
        activation_checkpointing: plan with it (True, "selective", classes or a callable, as
            ``Session(activation_checkpointing=...)``): the simulated step really checkpoints,
            so only block inputs are kept and one block is recomputed at a time in backward.

    Returns:
        A :class:`MemoryEstimate` breakdown.

    Raises:
        ConfigurationError: for an unknown precision or optimizer, or no example batch.
        MemoryPlanError: when the model cannot run on fake tensors.
    """
    param_dtype, autocast_dtype, precision = _precision_dtypes(precision)
    checkpointing = check_policy(activation_checkpointing)
    if example_batch is None:
        raise ConfigurationError("estimate_memory needs example_batch=... (e.g. torch.empty(64, 3, 32, 32)) to size activations.")
    opt_cls, opt_defaults = optimizer_class(optimizer)
    target = _planned_device(device)
    opt_defaults = as_on_device(opt_cls, opt_defaults, target.type)  # CUDA's foreach, not the CPU loop
    block = _CUDA_BLOCK if target.type == "cuda" else 1
    step = StepSpec(opt_cls, opt_defaults, example_batch, param_dtype, autocast_dtype, block, loss_fn, _SIMULATED_STEPS)
    try:
        figures = _from_short_copies(model, step, checkpointing) if _SIMULATED_STEPS == 1 else None
        if figures is None:
            figures = simulate_step(model, step, checkpointing)
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        raise MemoryPlanError(
            f"estimate_memory could not trace {type(model).__name__} on fake tensors ({type(exc).__name__}: {exc}). "
            "Operations that read tensor values (.item(), data-dependent shapes, custom C++ ops) cannot run without data."
        ) from exc
    notes = list(figures["notes"])
    if figures["checkpointed"]:
        notes.append(f"activation checkpointing ({policy_name(checkpointing)}): {figures['checkpointed']} "
                     "block(s) keep their input and are recomputed in backward")
    overall_peak, state = figures["peak"], figures["state"]
    if not figures["simulated_optimizer"] and opt_cls is not None:
        per_param = STATE_PER_PARAM.get(opt_cls.__name__, 2)
        state = per_param * figures["parameters"]
        overall_peak += state
        notes.append(f"{opt_cls.__name__} state estimated as {per_param} tensor(s) per parameter")
    return MemoryEstimate(
        peak_bytes=overall_peak,
        parameters_bytes=figures["parameters"],
        buffers_bytes=figures["buffers"],
        inputs_bytes=figures["inputs"],
        gradients_bytes=figures["grads"],
        optimizer_state_bytes=state,
        activations_bytes=max(0, figures["fwd_bwd_peak"] - figures["grads"]),
        precision=precision,
        device=str(target),
        notes=tuple(notes),
        activation_checkpointing=policy_name(checkpointing),
        flops=int(figures["flops"]),
    )


#: within :func:`same_model`: what the planner found of a model's structure, by (model, what, policy)
_STRUCTURE: ContextVar[dict[tuple[Any, ...], Any] | None] = ContextVar("gpukit_planner_structure", default=None)


@contextlib.contextmanager
def same_model() -> Iterator[None]:
    """Plans made inside find a model's run of alike blocks and the blocks a policy checkpoints
    once per model and policy, not once per plan: for callers that plan one model, unchanged,
    many times (``fit``: every precision, policy and micro-batch)."""
    token = _STRUCTURE.set({})
    try:
        yield
    finally:
        _STRUCTURE.reset(token)


def _structure(model: torch.nn.Module, what: str, checkpointing: Any, compute: Callable[[], Any]) -> Any:
    memo = _STRUCTURE.get()
    if memo is None:
        return compute()
    try:
        key: tuple[Any, ...] = (id(model), what, checkpointing, hash(checkpointing))
    except TypeError:  # an unhashable policy (a list of classes): this very object
        key = (id(model), what, "id", id(checkpointing))
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def _from_short_copies(model: torch.nn.Module, step: StepSpec, checkpointing: Any) -> dict[str, Any] | None:
    """The figures of ``model`` from two copies with its run of alike blocks cut short (see
    ``_repeat.py``), or ``None`` when it has no such run or the copies do not behave as expected."""
    run = _structure(model, "run", checkpointing, lambda: find_run(model, checkpointing))
    if run is None:
        return None
    targets = _structure(model, "targets", checkpointing,
                         lambda: checkpoint_targets(model, checkpointing) if checkpointing is not None else [])
    found = []
    for units in _SHORT_UNITS:
        try:
            with reduced(model, run, units, checkpointing, targets) as (blocks, policy):
                figures = simulate_step(model, step, policy, marks=(blocks, run.unit))
        except (RuntimeError, TypeError, NotImplementedError, ValueError, IndexError, KeyError):
            return None  # a model that cannot run cut short: simulate it whole
        cut = segments(figures.pop("marks") or [], units)
        if cut is None or max(v for k, v in cut["peak"].items() if k != ("E",)) != figures["fwd_bwd_peak_abs"]:
            return None
        found.append({**{k: v for k, v in figures.items() if isinstance(v, int) and not isinstance(v, bool)},
                      "segments": cut})
    full = extend(*found, _SHORT_UNITS[0], run.units)
    fwd_bwd_peak = full["fwd_bwd_peak_abs"] - full["before_forward"]
    peak = max(full["fwd_bwd_peak_abs"], full["opt_peak"], full["live_after"] + fwd_bwd_peak)
    return {**full, "peak": peak, "fwd_bwd_peak": fwd_bwd_peak, "notes": figures["notes"],
            "simulated_optimizer": figures["simulated_optimizer"],
            "checkpointed": len(targets)}


def _precision_dtypes(precision: str) -> tuple[torch.dtype, torch.dtype | None, str]:
    """``(parameter dtype, autocast dtype, canonical name)`` as :mod:`gpukit.precision` defines them."""
    planned = [name for name in PRECISIONS if name != "auto"]
    if not isinstance(precision, str) or precision.strip().lower() == "auto":
        raise ConfigurationError(
            f"estimate_memory(precision={precision!r}): expected one of {', '.join(map(repr, planned))} "
            "(\"auto\" depends on the GPU that will run it: name the precision to plan for)."
        )
    # The dtypes do not depend on the device, and the CPU accepts every precision, so this asks
    # gpukit.precision (the one owner of the names and dtype rules) without touching a GPU.
    try:
        chosen = get_precision(precision, get_accelerator("cpu"), torch.device("cpu"))
    except ConfigurationError as exc:
        raise ConfigurationError(f"estimate_memory(precision={precision!r}): expected one of {', '.join(map(repr, planned))}.") from exc
    return chosen.param_dtype, chosen.autocast_dtype, chosen.name


#: steps simulated: 1, and the second derived (see the module docstring); 2 for the reference
_SIMULATED_STEPS = 1
#: units of the two short copies a run of alike blocks is planned from (_repeat.py)
_SHORT_UNITS = (2, 3)
