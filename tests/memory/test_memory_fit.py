"""gpukit.memory.fit and `gpukit plan --fit`: the cheapest configuration that fits, checked
against real allocations measured on the CPU (torch's profiler)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpukit.errors import ConfigurationError
from gpukit.memory import fit, measure_step_memory

sys.path.insert(0, str(Path(__file__).parent))
from planner_models import mlp  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1] / "cli"))
from cli_helpers import importable_models, run_gpukit  # noqa: E402

_POLICY = {"none": None, "selective": "selective", "full": True}


def _measured_peak(model: torch.nn.Module, x: torch.Tensor, option: object) -> int:
    return measure_step_memory(copy.deepcopy(model), x[: option.micro_batch], precision=option.precision,
                               activation_checkpointing=_POLICY[option.activation_checkpointing]).peak_bytes


@pytest.mark.slow
def test_chosen_configuration_fits_when_measured_and_the_cheaper_one_does_not() -> None:
    torch.manual_seed(0)
    model, x = mlp(width=64, depth=4), torch.randn(256, 64)
    kwargs = dict(device="cpu", strategies=["single"], precisions=["32-true", "bf16-true"])
    unlimited = fit(model, x, memory="1GiB", top=1, **kwargs)
    fastest = unlimited.best
    assert fastest is not None and fastest.accumulate == 1 and fastest.activation_checkpointing == "none"
    budget = int(fastest.peak_bytes * 0.9)  # the fastest configuration no longer fits
    result = fit(model, x, memory=budget, top=3, **kwargs)
    best, cheaper = result.best, result.cheaper_rejected
    assert best is not None and cheaper is not None and best != fastest
    assert cheaper.step_s <= best.step_s and (cheaper.precision, cheaper.micro_batch) == (fastest.precision, fastest.micro_batch)
    assert _measured_peak(model, x, best) <= budget < _measured_peak(model, x, cheaper)
    assert [o.step_s for o in result.options] == sorted(o.step_s for o in result.options)
    text = str(result)
    assert "cheapest first" in text and best.session_line() in text and "Session(precision=" in text


def test_nothing_fits_says_by_how_much_and_session_lines() -> None:
    model, x = mlp(width=64, depth=2), torch.randn(64, 64)
    result = fit(model, x, memory="16KiB", device="cpu", strategies=["single"], precisions=["bf16-true"])
    assert result.best is None and result.closest is not None
    assert "nothing fits" in str(result) and "more per device" in str(result)
    line = fit(model, x, memory="1GiB", devices=2, device="cpu", strategies=["fsdp-offload"],
               precisions=["32-true"], checkpointing=["none"]).best.session_line()
    assert line.startswith("Session(devices=2, strategy=gpukit.strategies.FSDPStrategy(cpu_offload=True)")
    with pytest.raises(ConfigurationError, match="Invalid size"):
        fit(model, x, memory="lots")
    with pytest.raises(ConfigurationError, match="unknown"):
        fit(model, x, memory="1GiB", strategies=["zero3"])
    for nothing in (0, "0GiB", "0.5"):  # no bytes at all (it divided by the budget: ZeroDivisionError)
        with pytest.raises(ConfigurationError, match=r"fit\(memory=.*0 bytes.*24GiB"):
            fit(model, x, memory=nothing, device="cpu")


def test_session_fit_of_no_bytes_is_refused() -> None:
    import gpukit

    for nothing in (0, "0MiB"):  # it failed at setup with "could not plan the model: ZeroDivisionError"
        with pytest.raises(ConfigurationError, match=r"Session\(fit=.*0 bytes.*fit='20GiB'"):
            gpukit.Session("cpu", fit=nothing, verbose=False)


@pytest.mark.slow
def test_cli_plan_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    models = importable_models(tmp_path, monkeypatch, "from planner_models import mlp\n"
                               "def small():\n    return mlp(width=64, depth=2)\n", "fitmodels")
    args = ["plan", f"{models}:small", "--batch-shape", "64,64", "--device", "cpu"]
    # The four plans run the console entry point in this process (each subprocess paid ~3 s of
    # interpreter and torch start-up before planning); the two refusals, which stop before torch
    # is imported, still run as the real command, for the process's exit status and stderr.
    code, out, err = run_gpukit(capsys, *args, "--fit", "1GiB", "--nproc", "2")
    assert code == 0, err
    assert "cheapest first" in out and "Session(" in out
    # issue 41.22c: --nproc 2 ranks what runs in 2 processes, and says what it left out
    ranked, _, note = out.partition("not ranked: ")
    assert note.startswith("single, pipeline") and "--nproc 2 asks for 2" in note
    assert "pipeline x2" not in ranked and " single " not in ranked
    assert "tensor parallel (collectives priced over an assumed 200 GB/s intra-node link):" in out
    code, out, err = run_gpukit(capsys, *args, "--fit", "1GiB", "--nproc", "2", "--json")
    assert code == 0, err
    listed = json.loads(out)
    assert {o["strategy"] for o in listed["options"]} <= {"ddp", "fsdp", "fsdp-offload", "tp2"} and listed["options"]
    assert all(o["devices"] == 2 and o["layout"]["one_process"] is False for o in listed["options"])
    # the keys kept, tensor added: each option's degree, and the line per degree with the link assumed
    assert {o["tensor"] for o in listed["options"]} <= {1, 2}
    assert listed["tensor"]["link_bytes_per_s"] == 200e9 and listed["tensor"]["node_gpus"] == 2
    assert [line.split(":")[0] for line in listed["tensor"]["degrees"]] == ["tp 2"]
    for extra in ([], ["--json"]):  # nothing fits: what is missing, then a status scripts can test
        code, out, err = run_gpukit(capsys, *args, "--fit", "64KiB", *extra)
        assert code == 2, err
        if extra:
            assert json.loads(out)["options"] == [] and json.loads(out)["closest"]
        else:
            assert "nothing fits" in out and "closest:" in out and "more per device" in out
    base = [sys.executable, "-m", "gpukit", *args]
    bad = subprocess.run([*base, "--fit", "lots"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("gpukit: error:") and "Invalid size" in bad.stderr
    jobs = subprocess.run([*base, "--jobs", "2"], capture_output=True, text=True, timeout=120)
    assert jobs.returncode == 2 and "--jobs 2 goes with --fit" in jobs.stderr and "Traceback" not in jobs.stderr


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_a_reused_planner_ranks_the_same_and_plans_less(name: str) -> None:
    from planner_models import MODELS

    from gpukit.memory import FitPlanner

    factory, data = MODELS[name]
    torch.manual_seed(0)
    model, x = factory(), data(32)
    kwargs = dict(device="cpu", devices=2, precisions=["32-true", "bf16-true"], top=4)
    roomy = fit(model, x, memory="1GiB", **kwargs)
    budget = int(min(o.peak_bytes for o in roomy.options) * 0.95)  # the roomy winners no longer fit
    fresh_planner = FitPlanner(model, x, "adam", "cpu")
    fresh = fit(model, x, memory=budget, planner=fresh_planner, **kwargs)
    shared = FitPlanner(model, x, "adam", "cpu")
    fit(model, x, memory="1GiB", planner=shared, **kwargs)
    before = shared.plans
    again = fit(model, x, memory=budget, planner=shared, **kwargs)
    assert (again.options, again.closest, again.cheaper_rejected) == (fresh.options, fresh.closest, fresh.cheaper_rejected)
    assert fresh.options and fresh.options != roomy.options[: len(fresh.options)]
    assert shared.plans - before < fresh_planner.plans  # only the sizes the first call had not planned
    with pytest.raises(ConfigurationError, match="built for another model"):
        fit(mlp(width=8, depth=1), x, memory="1GiB", planner=shared)


def test_a_gpu_plan_that_leaves_little_of_the_budget_says_so() -> None:
    """A planned peak of 99% of a GPU's budget was printed as fitting with nothing said: the CUDA context,
    library workspaces and the allocator's fragmentation are not in the plan."""
    model, x = mlp(width=64, depth=2), torch.randn(64, 64)
    kwargs = dict(device="cuda", strategies=["single"], precisions=["32-true"], checkpointing=["none"], top=1)
    peak = fit(model, x, memory="1GiB", **kwargs).best.peak_bytes
    tight = fit(model, x, memory=int(peak / 0.99), **kwargs)
    assert tight.best is not None and tight.best.peak_bytes == peak
    assert "not planned" in str(tight) and "(1%) of the budget" in str(tight), str(tight)
    assert not any("not planned" in n for n in fit(model, x, memory=int(peak / 0.8), **kwargs).notes)
    assert not any("not planned" in n for n in fit(model, x, memory=int(peak / 0.99), **{**kwargs, "device": "cpu"}).notes)
