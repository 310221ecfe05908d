"""`gpukit plan` with keyword inputs (--input NAME=SHAPE[:DTYPE]) and factories returning (model, inputs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from cli_helpers import importable_models, run_gpukit

MODELS = """
import torch
from torch import nn

class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 64)

    def forward(self, x, mask=None):
        h = self.fc(x)
        return h if mask is None else h * mask.unsqueeze(-1)

def masked():
    return Masked()

def masked_with_inputs():
    return Masked(), {"x": torch.empty(8, 32), "mask": torch.empty(8)}

def bad_pair():
    return Masked(), 42

def llama(labels=True):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config)

def llama_with_inputs():
    ids = torch.empty(4, 64, dtype=torch.int64, device="meta")
    return llama(), {"input_ids": ids, "labels": ids}
"""


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    return importable_models(tmp_path, monkeypatch, MODELS, "gpukit_plan_inputs")


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    code, out, err = run_gpukit(capsys, "plan", *args, "--json")
    assert code == 0, err
    return json.loads(out)


def test_keyword_inputs_and_factory_inputs_plan_the_same(models: str, capsys: pytest.CaptureFixture[str]) -> None:
    cpu = ("--device", "cpu")  # bytes as allocated, without the CUDA allocator's 512-byte blocks
    by_name = _plan(capsys, f"{models}:masked", "--input", "x=8,32", "--input", "mask=8", *cpu)
    from_factory = _plan(capsys, f"{models}:masked_with_inputs", *cpu)
    without_mask = _plan(capsys, f"{models}:masked", "--input", "x=8,32", *cpu)
    assert by_name == from_factory
    assert by_name["inputs_bytes"] == (8 * 32 + 8) * 4 and without_mask["inputs_bytes"] == 8 * 32 * 4
    assert by_name["peak_bytes"] > without_mask["peak_bytes"]  # the mask's product is kept for backward


def test_hugging_face_model_planned_on_its_own_loss(models: str, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'gpukit[test]')")
    import torch

    from gpukit.memory import estimate_memory

    ids = ["--input", "input_ids=4,64:int64"]
    with_labels = _plan(capsys, f"{models}:llama", *ids, "--input", "labels=4,64:int64", "--optimizer", "adamw")
    assert _plan(capsys, f"{models}:llama_with_inputs", "--optimizer", "adamw") == with_labels
    logits_only = _plan(capsys, f"{models}:llama", *ids, "--optimizer", "adamw")
    # the loss (cross-entropy over fp32 logits) is planned, not a mean of the logits
    assert with_labels["activations_bytes"] > logits_only["activations_bytes"]
    module = sys.modules[models]
    meta = torch.empty(4, 64, dtype=torch.int64, device="meta")
    explicit = estimate_memory(module.llama(), "adamw", {"input_ids": meta, "labels": meta},
                               loss_fn=lambda output: output.loss)
    assert explicit.peak_bytes == with_labels["peak_bytes"]


@pytest.mark.parametrize("args, expected", [
    (["--input", "x"], "expected NAME=SHAPE[:DTYPE]"),
    (["--input", "1x=8,32"], "expected NAME=SHAPE[:DTYPE]"),
    (["--input", "x=8,32:float8"], "dtype 'float8' is not one of"),
    (["--input", "x=8,y"], "--input x= '8,y': expected positive integers"),
    (["--input", "x=8,32", "--input", "x=8,32"], "names one argument twice"),
    (["--input", "x=8,32", "--batch-shape", "8,32"], "not both"),
    (["--input", "x=8,32", "--dtype", "int64"], "--dtype goes with --batch-shape"),
    ([], "No inputs to plan with"),
])
def test_bad_inputs_are_one_line(models: str, capsys: pytest.CaptureFixture[str], args: list[str],
                                 expected: str) -> None:
    code, _, err = run_gpukit(capsys, "plan", f"{models}:masked", *args)
    assert code == 2 and err.startswith("gpukit: error:") and expected in err, err
    assert len(err.strip().splitlines()) == 1


def test_factory_pairs_checked(models: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_gpukit(capsys, "plan", f"{models}:bad_pair")
    assert code == 2 and "the second item must be the example inputs" in err
    code, _, err = run_gpukit(capsys, "plan", f"{models}:masked_with_inputs", "--input", "x=8,32")
    assert code == 2 and "returns its own example inputs" in err
