"""Memory: see it (reports), explain it (leak detection), fix it (OOM back-off, batch-size
search, planning, post-mortems).

Entry points for :class:`gpukit.Session` (each works on its own as well):

* ``memory_report(devices)`` -> :class:`MemoryReport` (``session.memory_report()``).
* ``LeakWatcher(every_n_steps, device=...)``; ``.step()`` per step or ``.attach(optimizer)``
  (``session.watch_memory(...)``), ``inference_guard(model)`` per set-up model.
* ``OomBackoff(micro_batch_size, device=..., zero_grad=..., parameters=..., no_sync=...)``
  with ``.run(step_fn, batch)`` (``Session(oom="backoff")`` + ``session.run_step``).
* ``forward_units(model, example, dtype)``: the forward-only (inference) plan's per-unit figures.
* ``fit(model, example_input, memory="24GiB", devices=N)``: the cheapest configuration that fits
  (tensor-parallel groups included: ``tensor_split(model, degree)`` finds what a degree splits, for the
  planner and for the strategy that splits it).
* ``free_memory(device)`` (``session.free_memory()``), ``oom_postmortem(device=...)``.
"""

from __future__ import annotations

from gpukit.memory._activation import (
    ActivationCheckpointing,
    apply_activation_checkpointing,
    check_policy,
    checkpoint_targets,
    is_checkpointed,
    policy_name,
)
from gpukit.memory._advice import planned_fixes
from gpukit.memory._backoff import (
    BackoffEvent,
    OomBackoff,
    OutOfMemoryAfterBackoffError,
    StepOutOfMemoryError,
    average_gradients,
    batch_length,
)
from gpukit.memory._batch_search import BatchSizeResult, BatchSizeTrial, find_batch_size
from gpukit.memory._blocks import (
    BLOCK_TYPES,
    DEFAULT_MIN_UNIT_PARAMS,
    AutoWrap,
    find_blocks,
    unit_param_counts,
    units_to_shard,
)
from gpukit.memory._forward import (ForwardUnit, KvShape, check_workload, forward_units, kv_shape, model_units,
                                    planned_dtype, unit_tensor_names)
from gpukit.memory._free import free_memory
from gpukit.memory._inference_guard import InferenceGradWarning, InferenceGuard, inference_guard
from gpukit.memory._leaks import LeakFinding, LeakWatcher, MemoryLeakWarning, watch
from gpukit.memory._live import live_tensor_bytes
from gpukit.memory._fit import PRECISIONS as FIT_PRECISIONS
from gpukit.memory._fit import FitOption, FitResult, fit
from gpukit.memory._fit_planner import FitPlanner, example_batch_size
from gpukit.memory._plan_workers import available_workers
from gpukit.memory._measure import measure_peak_memory
from gpukit.memory._measure_cpu import MeasuredMemory, forward_backward, measure_step_memory
from gpukit.memory._planner import MemoryEstimate, estimate_memory
from gpukit.memory._shard_plan import fsdp_unit_numels, shard_estimate
from gpukit.memory._tp_structure import TensorSplit, TensorSplitError, check_divides, tensor_split
from gpukit.memory._postmortem import (
    Allocation,
    largest_allocations,
    oom_postmortem,
    record_memory_history,
    write_oom_snapshot,
)
from gpukit.memory._report import DeviceMemory, MemoryReport, memory_report, show_utilization

__all__ = [
    "memory_report",
    "show_utilization",
    "MemoryReport",
    "DeviceMemory",
    "live_tensor_bytes",
    "LeakWatcher",
    "LeakFinding",
    "MemoryLeakWarning",
    "watch",
    "InferenceGuard",
    "InferenceGradWarning",
    "inference_guard",
    "OomBackoff",
    "BackoffEvent",
    "OutOfMemoryAfterBackoffError",
    "StepOutOfMemoryError",
    "average_gradients",
    "find_batch_size",
    "BatchSizeResult",
    "BatchSizeTrial",
    "estimate_memory",
    "forward_units",
    "ForwardUnit",
    "KvShape",
    "kv_shape",
    "model_units",
    "unit_tensor_names", "planned_dtype",
    "check_workload",
    "shard_estimate",
    "TensorSplit",
    "TensorSplitError",
    "check_divides",
    "tensor_split",
    "fsdp_unit_numels",
    "MemoryEstimate",
    "measure_peak_memory",
    "measure_step_memory",
    "forward_backward",
    "MeasuredMemory",
    "fit",
    "FitResult",
    "FitOption",
    "FitPlanner",
    "available_workers",
    "free_memory",
    "write_oom_snapshot",
    "oom_postmortem",
    "record_memory_history",
    "largest_allocations",
    "Allocation",
    # for the layers above (the Session, the strategies): what they share with the planner
    "FIT_PRECISIONS",
    "example_batch_size",
    "batch_length",
    "planned_fixes",
    "ActivationCheckpointing",
    "apply_activation_checkpointing",
    "check_policy",
    "checkpoint_targets",
    "is_checkpointed",
    "policy_name",
    "BLOCK_TYPES",
    "DEFAULT_MIN_UNIT_PARAMS",
    "AutoWrap",
    "find_blocks",
    "unit_param_counts",
    "units_to_shard",
]
