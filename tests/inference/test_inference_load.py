"""load_for_inference: outputs equal to the model run whole in memory (bit-exact), from every checkpoint
kind, resident or streamed from disk; requests beyond the plan refused before they run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gpukit.errors import CheckpointError, MemoryPlanError, StateDictMismatchError
from gpukit.inference import WorkloadError, load_for_inference

from inference_models import tiny_llama

IDS = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))


def _generate(model: nn.Module) -> torch.Tensor:
    mask = torch.ones_like(IDS)
    return model.generate(IDS, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)


def _expected(whole: Any) -> torch.Tensor:
    """The whole model's tokens (generated once per module: the machine's CPUs are shared)."""
    if "tokens" not in whole.expected:
        whole.expected["tokens"] = _generate(whole)
    return whole.expected["tokens"]


@pytest.mark.parametrize("budget", [{"cpu": "100MiB"}, {"cpu": "700KiB", "disk": "1GiB"}],
                         ids=["resident", "disk-offload"])
def test_generate_equals_the_whole_model(llama_folder: tuple[Path, Any], budget: dict[str, str]) -> None:
    folder, whole = llama_folder
    model = load_for_inference(folder, batch_size=2, prompt_len=10, new_tokens=6, max_memory=budget)
    run = model.gpukit_inference
    assert ("disk" in run.plan.device_map.values()) == ("disk" in budget)
    assert torch.equal(_generate(model), _expected(whole))
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, whole(IDS).logits)
    if "disk" in budget:
        assert run.streamer is not None and run.streamer.bytes_streamed > 0
        assert run.measured_tokens_per_s is not None and run.plan.tokens_per_s_bound is not None
        assert "tokens/s" in run.summary()
    run.close()


def test_a_tied_output_head_is_loaded_once_with_its_embedding(llama_folder: tuple[Path, Any]) -> None:
    folder, whole = llama_folder
    model = load_for_inference(folder, batch_size=2, prompt_len=10, new_tokens=6, max_memory={"cpu": "100MiB"})
    assert model.lm_head.weight is model.model.embed_tokens.weight  # one tensor, as the plan counts it
    unique = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    assert sum(t.numel() * t.element_size() for t in unique.values()) == sum(model.gpukit_inference.plan.unit_bytes.values())
    model.gpukit_inference.close()


def test_prefetching_several_units_ahead_gives_the_same_tokens(llama_folder: tuple[Path, Any]) -> None:
    folder, whole = llama_folder
    model = load_for_inference(folder, batch_size=2, prompt_len=10, new_tokens=6, prefetch=3,
                               max_memory={"cpu": "700KiB", "disk": "1GiB"})
    assert len(model.gpukit_inference.plan.offloaded) > 3
    assert torch.equal(_generate(model), _expected(whole))
    model.gpukit_inference.close()


def test_a_request_beyond_the_plan_is_refused_before_it_runs(llama_folder: tuple[Path, Any]) -> None:
    folder, _ = llama_folder
    model = load_for_inference(folder, batch_size=2, prompt_len=10, new_tokens=6, max_memory={"cpu": "100MiB"})
    with pytest.raises(WorkloadError, match="2 x 26 tokens"):
        model.generate(IDS, max_new_tokens=16, do_sample=False)
    with pytest.raises(WorkloadError, match="batch 3"):
        model(torch.zeros(3, 4, dtype=torch.int64))
    with pytest.raises(WorkloadError, match="2 x 20 tokens"):
        model(torch.zeros(2, 20, dtype=torch.int64))


def test_a_cache_passed_in_counts_against_the_plan(llama_folder: tuple[Path, Any]) -> None:
    folder, _ = llama_folder
    model = load_for_inference(folder, batch_size=2, prompt_len=10, new_tokens=6, max_memory={"cpu": "100MiB"})
    with torch.no_grad():
        cache = model(IDS, use_cache=True).past_key_values  # a Cache object: 10 tokens
        with pytest.raises(WorkloadError, match="2 x 17 tokens"):
            model(torch.zeros(2, 7, dtype=torch.int64), past_key_values=cache)
    legacy = tuple((torch.zeros(2, 2, 15, 16), torch.zeros(2, 2, 15, 16)) for _ in range(4))  # transformers 4.x's tuples
    with pytest.raises(WorkloadError, match="2 x 21 tokens"):
        model(torch.zeros(2, 6, dtype=torch.int64), past_key_values=legacy)


def test_a_workload_that_cannot_fit_is_refused_before_any_weight_is_read(llama_folder: tuple[Path, Any],
                                                                          tmp_path: Path) -> None:
    folder, _ = llama_folder
    with pytest.raises(MemoryPlanError, match="What would fit"):
        load_for_inference(folder, batch_size=64, prompt_len=100, new_tokens=20, max_memory={"cpu": "2MiB"})


def test_a_plain_module_from_a_torch_file(tmp_path: Path) -> None:
    import gpukit

    torch.manual_seed(0)
    whole = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(6)]).eval()
    gpukit.save(whole.state_dict(), tmp_path / "weights.pt")
    gpukit.save(whole.state_dict(), tmp_path / "weights.safetensors")
    x = torch.randn(8, 64)

    def build() -> nn.Module:
        return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(6)])

    for name in ("weights.pt", "weights.safetensors"):
        model = load_for_inference(build, tmp_path / name, example_input=x,
                                   max_memory={"cpu": "60KiB", "disk": "1GiB"})
        assert model.gpukit_inference.plan.offloaded
        with torch.no_grad():
            assert torch.equal(model(x), whole(x))
        with pytest.raises(WorkloadError, match="larger than the planned"):
            model(torch.randn(16, 64))


def test_a_sharded_dcp_step_directory(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    whole = tiny_llama(layers=2)
    state = {f"model.{k}": v.clone() for k, v in whole.state_dict().items() if k != "lm_head.weight"}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "step")), no_dist=True)
    factory = lambda: tiny_llama(layers=2)  # noqa: E731
    model = load_for_inference(factory, tmp_path / "step", batch_size=2, prompt_len=10, new_tokens=6,
                               max_memory={"cpu": "100MiB"})
    assert torch.equal(_generate(model), _generate(whole))
    with pytest.raises(CheckpointError, match="disk units are read from the checkpoint file as stored"):
        load_for_inference(factory, tmp_path / "step", batch_size=2, prompt_len=10, new_tokens=6,
                           max_memory={"cpu": "380KiB", "disk": "1GiB"})


def test_a_checkpoint_of_another_model_is_refused(llama_folder: tuple[Path, Any]) -> None:
    folder, _ = llama_folder
    with pytest.raises(StateDictMismatchError):
        load_for_inference(lambda: tiny_llama(layers=6), folder, batch_size=1, prompt_len=4,
                           max_memory={"cpu": "100MiB"})


def test_bfloat16_weights_match_the_model_cast_whole(llama_folder: tuple[Path, Any]) -> None:
    folder, whole = llama_folder
    model = load_for_inference(folder, batch_size=2, prompt_len=10, new_tokens=6, dtype=torch.bfloat16,
                               max_memory={"cpu": "100MiB"})
    reference = tiny_llama()
    reference.load_state_dict(whole.state_dict())
    for name, param in reference.named_parameters():
        param.data = param.data.to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reference(IDS).logits)


def test_a_model_id_not_in_the_local_cache_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpukit.errors import ConfigurationError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigurationError, match="neither a model folder nor a model id"):
        load_for_inference("nobody/no-such-model", batch_size=1, prompt_len=4, max_memory={"cpu": "100MiB"})
