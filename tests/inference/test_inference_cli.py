"""`gpukit plan MODULE:FACTORY --inference`: the map, each device's peak, the tokens/s bound; refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpukit.cli import cli, main

MODELS = """
import torch
from torch import nn

def llama():
    import transformers
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config)

def mlp():
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
"""


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "gpukit_inference_models.py").write_text(MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "gpukit_inference_models", raising=False)
    return "gpukit_inference_models"


def test_plan_inference_prints_the_map_peaks_and_bound(models: str) -> None:
    pytest.importorskip("transformers")
    result = CliRunner().invoke(cli, ["plan", f"{models}:llama", "--inference", "--batch-shape", "4,64",
                                      "--new-tokens", "16", "--max-memory", "cpu=1500KiB", "--max-memory", "disk=1GiB"])
    assert result.exit_code == 0, result.output
    assert "batch 4 x (64 prompt + 16 new) tokens" in result.output
    assert "disk" in result.output and "offloaded" in result.output and "tokens/s bound" in result.output
    result = CliRunner().invoke(cli, ["plan", f"{models}:llama", "--inference", "--batch-shape", "4,64", "--json",
                                      "--dtype", "bfloat16", "--max-memory", "cpu=1GiB"])
    data = json.loads(result.output)
    assert data["workload"]["dtype"] == "bfloat16" and set(data["device_map"].values()) == {"cpu"}
    assert data["devices"][0]["peak_bytes"] > data["devices"][0]["weights_bytes"] > 0


def test_plan_inference_of_a_plain_module_and_its_refusals(models: str, capsys: pytest.CaptureFixture[str]) -> None:
    result = CliRunner().invoke(cli, ["plan", f"{models}:mlp", "--inference", "--batch-shape", "32,256",
                                      "--max-memory", "cpu=1500KiB", "--max-memory", "disk=1GiB"])
    assert result.exit_code == 0, result.output
    assert "disk" in result.output
    for args, message in [(["--max-memory", "cpu=10KiB"], "Cannot place Sequential"),
                          (["--max-memory", "cpu"], "DEVICE=SIZE"),
                          (["--max-memory", "tpu=1GiB"], "'tpu'"),
                          (["--prompt-len", "8"], "--prompt-len/--new-tokens")]:
        with pytest.raises(SystemExit) as exit_info:
            main(["plan", f"{models}:mlp", "--inference", "--batch-shape", "32,256", *args])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_plan_inference_with_quantised_weights(models: str, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", f"{models}:mlp", "--inference", "--batch-shape", "32,256", "--max-memory", "cpu=1000KiB"]
    with pytest.raises(SystemExit) as exit_info:  # 6 x 257 KiB of float32 Linears do not fit 1000 KiB
        main(base)
    assert exit_info.value.code == 2 and "Cannot place Sequential" in capsys.readouterr().err
    result = CliRunner().invoke(cli, [*base, "--weights", "int8", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["workload"]["weights"] == "int8" and set(data["device_map"].values()) == {"cpu"}
    assert data["devices"][0]["weights_bytes"] == 6 * (256 * 256 + 2 * 256 * 4)  # int8 values, float32 scales and bias
    for args, message in [(["--weights", "int4"], "expected one of 'int8', 'float8'"),
                          (["--weights", "int8", "--batch-shape", "1"], "goes with --inference")]:
        with pytest.raises(SystemExit) as exit_info:
            main([*(base if "int4" in args else ["plan", f"{models}:mlp"]), *args])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
