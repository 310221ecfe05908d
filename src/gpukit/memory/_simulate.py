"""The planner's simulated step: the model on fake parameters (in backward too, where
checkpointed blocks run their forward again), with checkpointing and a "-true" precision's
casts applied for the simulation only, under :class:`LiveBytes`, which counts the bytes of
every storage an operator creates until it is freed. :func:`simulate_step` runs it and returns
the raw figures ``estimate_memory`` turns into a plan."""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry

from gpukit.errors import MemoryPlanError
from gpukit.memory._activation import checkpointing_applied
from gpukit.memory._fake_optimizer import make_optimizer, state_bytes
from gpukit.memory._repeat import SegmentMarks
from gpukit.precision import NORM_LAYERS, add_true_precision_casts

__all__ = ["LiveBytes", "StepSpec", "call_model", "default_loss", "norm_tensor_names", "simulate_step",
           "simulated", "true_precision_casts"]


@dataclass(frozen=True)
class StepSpec:
    """What a simulated step runs: the optimizer, the batch, the dtypes, the allocator's block."""

    opt_cls: type | None
    opt_defaults: dict[str, Any]
    example_batch: Any
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    block: int
    loss_fn: Callable[[Any], torch.Tensor] | None
    steps: int = 1


class LiveBytes:
    """Counts live storage bytes of what operators create, freed via weakref callbacks (and, while
    ``count_flops``, the FLOPs of the operators ``torch.utils.flop_counter`` knows). Counting is on
    inside ``with tracker:``; the operators reach it through :class:`_CountingFakeMode`."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.live = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref[Any]] = {}
        self.count_flops = True
        self.flops = 0
        self.segment_peak = 0  # peak since the last mark (see mark)
        self.frozen = False  # frees no longer counted: the count was set from a known step
        self.marks: list[tuple[tuple[Any, ...], int, int]] = []
        self.active = False

    def __enter__(self) -> LiveBytes:
        self.active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.active = False

    def size(self, storage: Any) -> int:
        nbytes = int(storage.nbytes())
        return -(-nbytes // self.block) * self.block

    def track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._refs and self._refs[key]() is storage:
            return
        nbytes = self.size(storage)
        self._refs[key] = weakref.ref(storage, lambda _, key=key, nbytes=nbytes: self._free(key, nbytes))
        self.live += nbytes
        if self.live > self.peak:
            self.peak = self.live
        if self.live > self.segment_peak:
            self.segment_peak = self.live

    def _free(self, key: int, nbytes: int) -> None:
        self._refs.pop(key, None)
        if not self.frozen:
            self.live -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.live

    def mark(self, label: tuple[Any, ...]) -> None:
        """Close the segment since the last mark and open ``label``'s: record ``(label, live now,
        the closed segment's peak)``."""
        self.marks.append((label, self.live, self.segment_peak))
        self.segment_peak = self.live

    def record(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Count what one operator made (its outputs' storages) and its FLOPs."""
        if self.count_flops and func.overloadpacket in flop_registry:  # as FlopCounterMode counts
            self.flops += flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
        if isinstance(out, torch.Tensor):
            self.track(out)
            return
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.track(leaf)


_DEVICE_QUERY = torch.ops.prim.device.default
_META = torch.device("meta")


class _CountingFakeMode(FakeTensorMode):
    """The fake-tensor mode that also hands every operator it runs, called from outside it, to a
    :class:`LiveBytes` while that counts: one Python mode per operator instead of a counting mode
    stacked on the fake one (the operators it runs for itself -- decompositions -- are not
    counted, as a mode above it would not see them).

    Each operator costs two fewer Python wrappers than a plain subclass would: torch wraps a
    mode's ``__torch_dispatch__`` to keep ``torch.compile`` out of it (this mode is never
    compiled: it only exists inside the planner), and the operator goes straight to
    ``FakeTensorMode.dispatch`` instead of through the base class's wrapped entry point. The
    device queries -- two of every three calls -- are answered here as ``FakeTensor`` answers
    them."""

    def __init__(self, tracker: LiveBytes) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.tracker = tracker
        self._depth = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _DEVICE_QUERY and len(args) == 1 and isinstance(args[0], FakeTensor):
            return _META if args[0].fake_mode.in_kernel_invocation else args[0].fake_device
        kwargs = kwargs or {}
        if self._depth or not self.tracker.active:
            return self.dispatch(func, types, args, kwargs)
        self._depth += 1
        try:
            out = self.dispatch(func, types, args, kwargs)
            self.tracker.record(func, args, kwargs, out)
        finally:
            self._depth -= 1
        return out


def call_model(model: torch.nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    return model(*batch) if isinstance(batch, (tuple, list)) else model(batch)


def default_loss(output: Any) -> torch.Tensor:
    # a model that computes its own loss (Hugging Face models given labels=) returns it as .loss
    own = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(own, torch.Tensor) and own.is_floating_point() and own.dim() == 0:
        return own
    leaves = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise MemoryPlanError("estimate_memory: the model returned no floating-point tensor; pass loss_fn=...")
    return sum(t.float().mean() for t in leaves)  # type: ignore[return-value]





@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """Silence FakeTensorMode's own error log: it prints torch's traceback of an op that failed
    before the exception reaches us, and the MemoryPlanError raised then says it in one line."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled






@contextlib.contextmanager
def simulated(
    model: torch.nn.Module, state: dict[str, torch.Tensor], checkpointing: Any, low: torch.dtype | None,
) -> Iterator[list[str]]:
    """``model`` running on the fake ``state`` -- for backward too, where checkpointed blocks
    run their forward again -- with ``checkpointing`` applied; all undone afterwards."""
    from torch.nn.utils.stateless import _reparametrize_module

    with _reparametrize_module(model, state), checkpointing_applied(model, checkpointing) as names, \
            true_precision_casts(model, low):
        yield names


def norm_tensor_names(model: torch.nn.Module) -> set[str]:
    """Parameters and buffers of the norm layers a "-true" precision keeps in fp32."""
    return {f"{prefix}.{name}" if prefix else name
            for prefix, sub in model.named_modules() if isinstance(sub, NORM_LAYERS)
            for name, _ in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]}


@contextlib.contextmanager
def true_precision_casts(model: torch.nn.Module, low: torch.dtype | None) -> Iterator[None]:
    """The casts ``TruePrecision.convert_module`` adds (fp32 norm layers; fp32 outputs), for the
    simulation only: they copy activations, which the plan must count."""
    if low is None or getattr(model, "_gpukit_precision", None) is not None:
        yield  # no "-true" precision, or the model was converted already (its hooks run)
        return
    handles = add_true_precision_casts(model, low, cast_inputs=False)  # the fake inputs are made low already
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


#: where the simulation runs, whatever the target: fake CUDA tensors would initialise CUDA (and abort a
#: CPU-only build in autograd); autograd's saved tensors do not depend on the device, and CPU autocast
#: casts the same matmul/conv family to the low dtype
_SIMULATED_DEVICE = torch.device("cpu")


def _fake_state(model: torch.nn.Module, step: StepSpec, tracker: LiveBytes
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
    """Fake parameters, buffers and inputs for a simulated step, in the dtypes it runs with, each
    counted by ``tracker`` (call inside its fake mode)."""
    param_dtype = step.param_dtype

    def fake_like(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        fake = torch.empty(tensor.shape, dtype=dtype or tensor.dtype, device=_SIMULATED_DEVICE)
        tracker.track(fake)
        return fake

    # "-true" precisions keep norm layers in fp32 (gpukit.precision.TruePrecision)
    fp32 = norm_tensor_names(model) if param_dtype != torch.float32 else set()

    def dtype_of(name: str, t: torch.Tensor) -> torch.dtype | None:
        return (torch.float32 if name in fp32 else param_dtype) if t.is_floating_point() else None

    params = {
        name: fake_like(p, dtype_of(name, p)).requires_grad_(p.requires_grad)
        for name, p in model.named_parameters()
    }
    buffers = {name: fake_like(b, dtype_of(name, b)) for name, b in model.named_buffers()}
    # "-true" precisions feed the model low-precision inputs too; an input that requires
    # grad keeps it (a middle layer, as gpukit.parallel plans one, sends gradients back)
    inputs = tree_map(
        lambda t: fake_like(t, param_dtype if t.is_floating_point() else None).requires_grad_(
            t.requires_grad and t.is_floating_point()
        ) if isinstance(t, torch.Tensor) else t,
        step.example_batch,
    )
    return params, buffers, inputs


def simulate_step(model: torch.nn.Module, step: StepSpec, checkpointing: Any,
                  marks: tuple[list[torch.nn.Module], int] | None = None) -> dict[str, Any]:
    """Run ``step.steps`` training steps of ``model`` on fake tensors; returns the raw figures.

    ``marks``: ``(blocks, unit)`` to mark every unit's forward and backward (``_repeat.py``);
    the figures then hold ``"marks"``, the segments' peaks in order.
    """
    tracker = LiveBytes(step.block)
    notes: list[str] = []
    param_dtype = step.param_dtype
    with _quiet_fake_tensor_log(), _CountingFakeMode(tracker):
        params, buffers, inputs = _fake_state(model, step, tracker)
        figures: dict[str, Any] = {
            "parameters": sum(tracker.size(p.untyped_storage()) for p in params.values()),
            "buffers": sum(tracker.size(b.untyped_storage()) for b in buffers.values()),
            "inputs": sum(tracker.size(t.untyped_storage()) for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)),
        }
        trainable = [p for p in params.values() if p.requires_grad]
        true_low = param_dtype if param_dtype != torch.float32 else None
        segment_marks = SegmentMarks(marks[0], marks[1], tracker.mark) if marks is not None else None
        try:
            with tracker, simulated(model, {**params, **buffers}, checkpointing, true_low) as checkpointed:
                fake_opt = make_optimizer(step.opt_cls, step.opt_defaults, trainable, notes)
                for number in range(step.steps):
                    before_forward = tracker.live
                    tracker.reset_peak()
                    if number == 0:
                        figures["before_forward"] = before_forward
                        tracker.mark(("S",))
                    with torch.autocast(_SIMULATED_DEVICE.type, dtype=step.autocast_dtype,
                                        enabled=step.autocast_dtype is not None):
                        output = call_model(model, inputs)
                        loss = (step.loss_fn or default_loss)(output)
                    loss.backward()
                    del output, loss
                    if number == 0:  # forward+backward FLOPs (recompute included): fit's cost model
                        figures["flops"], tracker.count_flops = tracker.flops, False
                        figures["fwd_bwd_peak_abs"] = tracker.peak
                        tracker.mark(("E",))
                    fwd_bwd_peak = tracker.peak - before_forward
                    grads = sum(tracker.size(p.grad.untyped_storage()) for p in trainable if p.grad is not None)
                    known = _known_optimizer_step(fake_opt, trainable, tracker) if step.steps == 1 else None
                    if known is not None:  # the same step on the same tensors ran before: its effect
                        known.apply(tracker, trainable)
                        figures["state"] = known.state_bytes
                    elif fake_opt is not None:
                        _run_optimizer_step(fake_opt, trainable, tracker, remember=step.steps == 1)
                    else:
                        for p in trainable:
                            p.grad = None
                    if number == 0:
                        overall_peak = tracker.peak
                        tracker.mark(("O",))
                        figures["live_after"] = tracker.live
                overall_peak = max(overall_peak, tracker.peak)
                if step.steps == 1:  # the second step's forward and backward start from here
                    overall_peak = max(overall_peak, tracker.live + fwd_bwd_peak)
                if "state" not in figures:
                    figures["state"] = state_bytes(fake_opt, tracker) if fake_opt is not None else 0
        finally:
            if segment_marks is not None:
                segment_marks.remove()
    if segment_marks is not None:
        figures["marks"] = None if segment_marks.failed else tracker.marks
    return {**figures, "grads": grads, "peak": overall_peak, "fwd_bwd_peak": fwd_bwd_peak, "notes": notes,
            "checkpointed": len(checkpointed), "simulated_optimizer": fake_opt is not None}


@dataclass(frozen=True)
class _OptimizerStep:
    """What one optimizer step (and ``zero_grad``) did to the live bytes, relative to its start."""

    peak_above_start: int
    live_change: int
    state_bytes: int

    def apply(self, tracker: LiveBytes, params: list[torch.Tensor]) -> None:
        """Count this step in ``tracker`` instead of running it; the gradients are dropped."""
        top = tracker.live + self.peak_above_start
        live = tracker.live + self.live_change
        tracker.frozen = True  # the gradients' frees below are in live_change already
        for p in params:
            p.grad = None
        tracker.live, tracker.peak, tracker.segment_peak = live, max(tracker.peak, top), max(tracker.segment_peak, top)


#: optimizer steps simulated in this process, by what determines them (see _optimizer_key); a
#: plan that meets one again (fit plans the same model at several batch sizes and checkpointing
#: policies: the same parameters and gradients each time) takes its effect instead of running it
_OPTIMIZER_STEPS: OrderedDict[tuple[Any, ...], _OptimizerStep] = OrderedDict()
_OPTIMIZER_STEPS_KEPT = 64


def _optimizer_key(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], block: int) -> tuple[Any, ...]:
    groups = tuple(tuple(sorted((k, repr(v)) for k, v in g.items() if k != "params")) for g in optimizer.param_groups)
    tensors = tuple((tuple(p.shape), p.dtype, p.grad is None or (tuple(p.grad.shape), p.grad.dtype,
                     p.grad.untyped_storage().nbytes(), p.grad.stride())) for p in params)
    return type(optimizer), groups, tensors, block


def _known_optimizer_step(optimizer: torch.optim.Optimizer | None, params: list[torch.Tensor],
                          tracker: LiveBytes) -> _OptimizerStep | None:
    if optimizer is None:
        return None
    return _OPTIMIZER_STEPS.get(_optimizer_key(optimizer, params, tracker.block))


def _run_optimizer_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], tracker: LiveBytes,
                        remember: bool) -> None:
    key = _optimizer_key(optimizer, params, tracker.block) if remember else None
    start, peak_before = tracker.live, tracker.peak
    tracker.peak = start
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    peak_above = tracker.peak - start
    tracker.peak = max(peak_before, tracker.peak)
    if key is not None:
        _OPTIMIZER_STEPS[key] = _OptimizerStep(peak_above, tracker.live - start, state_bytes(optimizer, tracker))
        while len(_OPTIMIZER_STEPS) > _OPTIMIZER_STEPS_KEPT:
            _OPTIMIZER_STEPS.popitem(last=False)
