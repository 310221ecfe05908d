"""plan_inference on meta models: the forward-only figures, the KV cache formula, budgets, refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpukit.devices import FakeNvml
from gpukit.errors import ConfigurationError, MemoryPlanError
from gpukit.inference import budgets, plan_inference
from gpukit.memory import forward_units, kv_shape, model_units

from inference_models import tiny_llama

MIB = 2**20


def _meta_llama(layers: int = 4) -> nn.Module:
    with torch.device("meta"):
        return tiny_llama(layers=layers)


def test_units_are_the_blocks_and_what_surrounds_them_in_forward_order() -> None:
    model = _meta_llama()
    units = forward_units(model, {"input_ids": torch.empty(2, 16, dtype=torch.int64)}, torch.float32)
    names = [u.name for u in units]
    assert names[0] == "model.embed_tokens" and names[-1] == "lm_head"
    assert [n for n in names if n.startswith("model.layers.")] == [f"model.layers.{i}" for i in range(4)]
    assert {u.name for u in units} == {n for n, _ in model_units(model)}
    by_name = {u.name: u for u in units}
    assert by_name["lm_head"].tied_to == "model.embed_tokens" and by_name["lm_head"].weights_bytes == 0
    assert sum(u.weights_bytes for u in units) == sum(p.numel() * 4 for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers())
    # a layer's peak is its MLP's intermediate activations: batch x tokens x 128 floats, several at once
    assert 2 * 16 * 128 * 4 <= by_name["model.layers.1"].peak_above_bytes <= 8 * 2 * 16 * 128 * 4
    assert [u.layer for u in units if u.layer is not None] == [0, 1, 2, 3]


def test_the_kv_cache_follows_the_formula() -> None:
    model = _meta_llama()
    shape = kv_shape(model)
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (4, 2, 16)
    plan = plan_inference(model, batch_size=8, prompt_len=100, new_tokens=28, max_memory={"cpu": "1GiB"})
    per_layer = 2 * 2 * 16 * 128 * 8 * 4  # 2 x kv_heads x head_dim x tokens x batch x fp32 bytes
    assert plan.bytes_per_token["cpu"] == sum(plan.unit_bytes.values()) + 4 * per_layer
    # decode-bound: a short prompt, many new tokens -> the full cache (plus one layer growing) at the peak
    long = plan_inference(model, batch_size=8, prompt_len=4, new_tokens=124, max_memory={"cpu": "1GiB"})
    short = plan_inference(model, batch_size=8, prompt_len=4, new_tokens=0, max_memory={"cpu": "1GiB"})
    assert long.peak_bytes("cpu") - short.peak_bytes("cpu") >= 4 * per_layer
    assert plan_inference(model, batch_size=8, prompt_len=100, new_tokens=28, dtype="bfloat16",
                          max_memory={"cpu": "1GiB"}).peak_bytes("cpu") < plan.peak_bytes("cpu") * 0.6


def test_a_workload_that_cannot_fit_is_refused_with_numbers_and_what_would_fit() -> None:
    model = _meta_llama()
    with pytest.raises(MemoryPlanError) as refused:
        plan_inference(model, batch_size=64, prompt_len=120, new_tokens=8, max_memory={"cpu": "4MiB"})
    text = str(refused.value)
    assert "batch 64 x 128 tokens" in text and "KV cache" in text and "cpu 4.00 MiB" in text
    assert "batch_size=" in text and "offload_dir" in text
    with pytest.raises(MemoryPlanError, match="bfloat16"):  # half the bytes fit where float32 does not
        plan_inference(model, batch_size=64, prompt_len=120, new_tokens=8, max_memory={"cpu": "20MiB"})


def test_a_plain_module_is_planned_from_its_example_input() -> None:
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)]).to("meta")
    plan = plan_inference(model, example_input=torch.empty(32, 256), max_memory={"cpu": "1200KiB", "disk": "1GiB"})
    assert plan.offloaded and plan.device_map["0"] == "cpu" and plan.device_map["5"] == "disk"
    assert plan.peak_bytes("cpu") <= 1200 * 1024
    with pytest.raises(ConfigurationError, match="example_input"):
        plan_inference(model, batch_size=2, prompt_len=4)


def test_bad_workloads_and_budgets_are_refused() -> None:
    model = _meta_llama()
    with pytest.raises(ConfigurationError, match="prompt_len"):
        plan_inference(model, batch_size=1)
    with pytest.raises(ConfigurationError, match="batch_size=0"):
        plan_inference(model, batch_size=0, prompt_len=4)
    with pytest.raises(ConfigurationError, match="'tpu'"):
        plan_inference(model, prompt_len=4, max_memory={"tpu": "1GiB"})
    with pytest.raises(ConfigurationError, match="dtype"):
        plan_inference(model, prompt_len=4, dtype="int8")


def test_default_budgets_are_free_memory_less_a_margin() -> None:
    spec = {"gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81920, "memory_used_mib": 20480},
                     {"name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81920, "memory_used_mib": 0}]}
    with FakeNvml(spec):
        found = budgets(None, None, host_available_bytes=64 * 2**30)
        assert [d.name for d in found] == ["cuda:0", "cuda:1", "cpu"]
        assert found[0].budget_bytes < 60 * 2**30 < found[1].budget_bytes < 80 * 2**30
        assert found[2].budget_bytes == int(64 * 2**30 * 0.8)
        plan = plan_inference(_meta_llama(), batch_size=1, prompt_len=16, max_memory={"cuda:0": "10GiB", "cpu": "1GiB"})
    assert plan.tokens_per_s_bound is not None and plan.tokens_per_s_bound > 1000  # 3.35 TB/s data sheet
    assert set(plan.device_map.values()) == {"cuda:0"}
