"""Inference of models bigger than a device: placed by the planner, streamed, never out of memory on the first token.

* ``plan_inference(model, batch_size=..., prompt_len=..., new_tokens=..., max_memory=...)`` ->
  :class:`InferencePlan`: where each unit goes (contiguous ranges over the GPUs, then CPU RAM, then
  disk), each device's predicted peak (weights, KV cache, activations), the tokens/s bound -- on the
  meta device, before any weight is read.
* ``load_for_inference(model_or_factory, checkpoint, max_memory=..., offload_dir=..., batch_size=...,
  prompt_len=..., new_tokens=..., dtype=...)``: the model built on meta, every tensor read from the
  checkpoint straight to its device, offloaded units streamed ahead of the compute, and any request
  beyond the planned workload refused before it runs (:class:`WorkloadError`); ``weights="int8"``
  (or ``"float8"``) stores each ``nn.Linear`` weight quantised per output row
  (:func:`quantize_linear_weights`, :class:`QuantizedLinear`).
"""

from __future__ import annotations

from gpukit.inference._budget import budgets
from gpukit.inference._guard import WorkloadError
from gpukit.inference._load import InferenceRun, load_for_inference
from gpukit.inference._placement import DeviceBudget
from gpukit.inference._plan import DevicePlan, InferencePlan, Workload, plan_inference
from gpukit.inference._quantized import QuantizedLinear, quantize_linear_weights

__all__ = ["load_for_inference", "InferenceRun", "WorkloadError", "plan_inference", "InferencePlan", "DevicePlan", "Workload", "DeviceBudget", "budgets",
           "QuantizedLinear", "quantize_linear_weights"]
