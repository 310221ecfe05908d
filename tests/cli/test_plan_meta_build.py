"""`gpukit plan` builds the factory's model on the meta device (no weights made), and a factory
that cannot run there is called again as written: the same plan either way."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from cli_helpers import importable_models, run_gpukit

from gpukit.memory import estimate_memory

MODELS = """
import torch
from torch import nn

CALLS = []  # the device each call of a factory made its weights on


def mlp():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    CALLS.append(model[0].weight.device.type)
    return model


def reads_a_value():
    model = mlp()
    if float(model[0].weight.detach().abs().sum()) < 0:  # a value: impossible on meta
        raise AssertionError("never")
    return model


def warns():
    import warnings
    warnings.warn("mind the gap", UserWarning)
    return mlp()


def always_fails():
    CALLS.append("called")
    raise RuntimeError("boom")
"""


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    return importable_models(tmp_path, monkeypatch, MODELS, "gpukit_plan_meta")


def _calls(models: str) -> list[str]:
    return importlib.import_module(models).CALLS


def test_the_model_is_built_on_meta_once(models: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_gpukit(capsys, "plan", f"{models}:mlp", "--batch-shape", "16,32", "--json")
    assert code == 0, err
    assert _calls(models) == ["meta"]
    torch.manual_seed(0)
    expected = estimate_memory(importlib.import_module(models).mlp(), "adam", torch.empty(16, 32))
    assert json.loads(out) == json.loads(json.dumps(expected.to_dict()))


def test_a_factory_that_reads_a_value_is_called_again_as_written(models: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_gpukit(capsys, "plan", f"{models}:reads_a_value", "--batch-shape", "16,32", "--json")
    assert code == 0, err
    assert _calls(models) == ["meta", "cpu"]  # failed on meta at the value, then built as written
    _calls(models).clear()
    code, meta_out, err = run_gpukit(capsys, "plan", f"{models}:mlp", "--batch-shape", "16,32", "--json")
    assert code == 0 and _calls(models) == ["meta"] and meta_out == out


def test_a_failing_factory_is_reported_from_its_own_call(models: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_gpukit(capsys, "plan", f"{models}:always_fails", "--batch-shape", "16,32")
    assert code == 2 and "always_fails() raised RuntimeError: boom at" in err and "Traceback" not in err
    assert _calls(models) == ["called", "called"]  # on meta, then as written (whose error is reported)


def test_the_factory_s_warnings_are_given_once(models: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.warns(UserWarning, match="mind the gap") as said:
        code, _, err = run_gpukit(capsys, "plan", f"{models}:warns", "--batch-shape", "16,32")
    assert code == 0, err
    assert [str(w.message) for w in said if "mind the gap" in str(w.message)] == ["mind the gap"]
    assert _calls(models) == ["meta"]
