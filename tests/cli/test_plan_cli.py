"""`gpukit plan module:factory`: thin CLI over estimate_memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli_helpers import importable_models, run_gpukit
from gpukit.cli import cli, main

MODELS = """
from torch import nn

def mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))

def lm():
    return nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 1000))

def not_a_model():
    return 42
"""


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    return importable_models(tmp_path, monkeypatch, MODELS, "gpukit_plan_models")


def test_plan_prints_a_breakdown(models: str) -> None:
    result = CliRunner().invoke(cli, ["plan", f"{models}:mlp", "--batch-shape", "64,32", "--optimizer", "sgd"])
    assert result.exit_code == 0, result.output
    assert "parameters" in result.output and "peak" in result.output and "32-true on cuda" in result.output


def test_plan_json_with_token_inputs_and_precision(models: str) -> None:
    args = ["plan", f"{models}:lm", "--batch-shape", "8,128", "--dtype", "int64", "--precision", "bf16-mixed", "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["precision"] == "bf16-mixed" and data["peak_bytes"] > data["parameters_bytes"] > 0


@pytest.mark.parametrize(
    "args,message",
    [
        (["{m}:nope", "--batch-shape", "2,32"], "has no callable 'nope'"),
        (["{m}:not_a_model", "--batch-shape", "2,32"], "not a torch.nn.Module"),
        (["no_colon", "--batch-shape", "2,32"], "module:factory"),
        (["{m}:mlp", "--batch-shape", "2,x"], "positive integers"),
        (["{m}:mlp", "--batch-shape", "2,32", "--precision", "auto"], "'auto' depends on the GPU"),
        (["{m}:mlp", "--batch-shape", "2,32", "--precision", "bf16-fast"], "choose one of '32-true', 'bf16-mixed'"),
    ],
)
def test_plan_errors_are_one_line(models: str, args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *(a.format(m=models) for a in args)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("gpukit: error:") and message in err


def test_plan_takes_the_precision_aliases_gpukit_precision_takes(models: str) -> None:
    result = CliRunner().invoke(cli, ["plan", f"{models}:mlp", "--batch-shape", "2,32", "--precision", "bf16", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["precision"] == "bf16-mixed"


def test_fsdp_without_nproc_uses_the_visible_gpus_and_says_so(models: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpukit.devices import _nvml

    examples = Path(__file__).resolve().parents[2] / "examples" / "fake-gpus"
    args = ["plan", f"{models}:mlp", "--batch-shape", "64,32", "--strategy", "fsdp", "--json"]
    monkeypatch.setenv("GPUKIT_FAKE_GPUS", str(examples / "shared-4gpu.json"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    _nvml.shutdown()
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "planning FSDP over 2 rank(s), the GPUs visible here" in result.stderr
    by_default = json.loads(result.stdout)
    explicit = json.loads(CliRunner().invoke(cli, [*args, "--nproc", "2"]).stdout)
    assert by_default == explicit
    monkeypatch.setenv("GPUKIT_FAKE_GPUS", str(examples / "no-driver.json"))
    _nvml.shutdown()
    result = CliRunner().invoke(cli, args)
    assert result.exit_code != 0 and "no GPU is visible here to count: give --nproc N" in str(result.exception)
    _nvml.shutdown()


@pytest.mark.parametrize("given", ["{m}.py", "./{m}.py", "sub/{m}.py", "{m}-v2"])
def test_a_file_path_for_the_module_is_refused_without_running_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], given: str) -> None:
    """'models.py:build' imported models.py (running it) and then failed; './models.py:build' raised TypeError."""
    marker = tmp_path / "ran"
    name = importable_models(tmp_path, monkeypatch, f"open({str(marker)!r}, 'w').close()\n" + MODELS, "gpukit_path_models")
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", f"{given.format(m=name)}:mlp", "--batch-shape", "2,32"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("gpukit: error:") and "is not a module name" in err, err
    assert f"'{name}:mlp'" in err or given == "{m}-v2"  # the name to give instead
    assert not marker.exists()  # the file's code never ran


def test_a_module_that_fails_on_import_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    name = importable_models(tmp_path, monkeypatch, "raise RuntimeError('no CUDA here')\n", "gpukit_bad_models")
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", f"{name}:mlp", "--batch-shape", "2,32"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "raised RuntimeError: no CUDA here" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (["--inference", "--fit", "1KiB"], "--fit: training options, which --inference does not use"),
    (["--inference", "--strategy", "fsdp", "--nproc", "2"], "--strategy, --nproc: training options"),
    (["--inference", "--optimizer", "sgd", "--precision", "bf16-mixed"], "--precision, --optimizer: training options"),
    (["--max-memory", "cuda:0=1KiB"], "--max-memory: inference options, which only --inference uses"),
    (["--new-tokens", "5", "--prompt-len", "8"], "--prompt-len, --new-tokens: inference options"),
])
def test_an_option_of_the_other_mode_is_refused(models: str, capsys: pytest.CaptureFixture[str], args: list[str],
                                                message: str) -> None:
    """They were ignored without a word: `--inference --fit 1KiB` printed a placement that never saw the 1 KiB."""
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", f"{models}:mlp", "--batch-shape", "2,32", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("gpukit: error:") and message in err, err


def test_fit_ranks_only_the_precision_and_strategy_given(models: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--fit 1GiB --precision bf16-true` ranked every precision: --precision and --strategy were ignored."""
    code, out, _ = run_gpukit(capsys, "plan", f"{models}:mlp", "--batch-shape", "64,32", "--fit", "1GiB",
                              "--precision", "bf16-true", "--json")
    options = json.loads(out)["options"]
    assert code == 0 and options and {o["precision"] for o in options} == {"bf16-true"}, out
    code, out, _ = run_gpukit(capsys, "plan", f"{models}:mlp", "--batch-shape", "64,32", "--fit", "1GiB",
                              "--nproc", "2", "--strategy", "ddp", "--json")
    options = json.loads(out)["options"]
    assert code == 0 and options and {o["strategy"] for o in options} <= {"ddp", "ddp+tp2"}, out
    assert len({o["precision"] for o in options}) > 1  # no --precision: every one ranked
    for args, message in ((["--strategy", "fsdp"], "fsdp runs in --nproc N >= 2 processes"),
                          (["--strategy", "single", "--nproc", "2"], "single runs in one process"),
                          (["--precision", "16-mixed"], "--fit ranks 32-true, bf16-mixed, bf16-true")):
        code, _, err = run_gpukit(capsys, "plan", f"{models}:mlp", "--batch-shape", "64,32", "--fit", "1GiB", *args)
        assert code == 2 and message in err, err
