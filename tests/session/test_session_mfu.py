"""A CPU Session counts the FLOPs of its first step, and shows MFU = achieved / peak in the epoch
line, ``session.mfu``, the run record and ``gpukit report``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.flop_counter import FlopCounterMode

import gpukit
from gpukit.errors import ConfigurationError
from gpukit.report import read_record, render_report, summarize

WIDTHS, BATCH = [32, 64, 48, 8], 16


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 8))


def _data() -> torch.utils.data.Dataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(8 * BATCH, 32, generator=g), torch.randint(0, 8, (8 * BATCH,), generator=g))


def _reference_flops() -> int:
    """torch's own count of the same step, outside gpukit."""
    model = _model()
    x, y = _data()[:BATCH]
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x), y).backward()
    return counter.get_total_flops()


def _train(session: gpukit.Session, *, run_step: bool = False, eval_first: bool = False) -> nn.Module:
    model = _model()
    model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = session.setup_dataloader(_data(), batch_size=BATCH)
    if eval_first:
        with torch.no_grad():  # a sanity pass before training is not the counted step
            model(torch.randn(4, 32))
    for x, y in loader:
        if run_step:
            session.run_step(lambda b: F.cross_entropy(model(b[0]), b[1]), (x, y))
        else:
            session.backward(F.cross_entropy(model(x), y))
        session.step(opt)
    return model


@pytest.mark.parametrize(("run_step", "eval_first"), [(False, False), (True, True)])
def test_a_cpu_session_with_peak_tflops_reports_mfu(capsys, run_step: bool, eval_first: bool) -> None:
    session = gpukit.Session(devices="cpu", precision="32-true", peak_tflops=0.5)
    model = _train(session, run_step=run_step, eval_first=eval_first)
    pairs = list(zip(WIDTHS, WIDTHS[1:]))
    forward = sum(2 * BATCH * i * o for i, o in pairs)
    expected = 2 * forward + sum(2 * BATCH * i * o for i, o in pairs[1:])  # no input gradient for layer 1
    assert session.flops_per_step == _reference_flops() == expected
    mfu = session.mfu
    assert mfu is not None and mfu.peak.tflops == 0.5 and mfu.peak.source == "given: Session(peak_tflops=...)"
    assert mfu.achieved_tflops > 0 and mfu.mfu == mfu.achieved_tflops / 0.5
    line = session.timings.epoch_reports[-1].line
    assert line == capsys.readouterr().err.strip().splitlines()[-1]  # the line printed is the one kept
    assert f"MFU {100 * mfu.mfu:.3g}% of 500 GFLOP/s (given: Session(peak_tflops=...))" in line
    assert not model._forward_pre_hooks  # the counter's hook is off: no later step pays for it
    session.close()


def test_an_evaluation_pass_gets_no_mfu() -> None:
    session = gpukit.Session(devices="cpu", precision="32-true", verbose=False, peak_tflops=0.5)
    model = _train(session)
    trained = session.mfu
    val = session.setup_dataloader(_data(), batch_size=BATCH)
    with torch.no_grad():  # evaluated the usual way
        for x, _ in val:
            model(x)
    for x, _ in val:  # and without no_grad, but with no session.step in the pass
        model(x).detach()
    lines = [r.line for r in session.timings.epoch_reports]
    assert len(lines) == 3 and "MFU" in lines[0] and "FLOP/s" not in lines[1] + lines[2]
    assert session.mfu is trained
    session.close()


def test_without_a_peak_the_cpu_shows_achieved_and_says_mfu_is_not_known() -> None:
    session = gpukit.Session(devices="cpu", precision="32-true", verbose=False)
    _train(session)
    mfu = session.mfu
    assert mfu is not None and mfu.mfu is None and mfu.achieved_tflops > 0
    assert "FLOP/s achieved (MFU not known: no fp32 peak known for this device: give Session(peak_tflops=...))" in (
        session.timings.epoch_reports[-1].line)
    session.close()


def test_the_second_run_step_is_counted_not_the_first_which_compiles() -> None:
    session = gpukit.Session(devices="cpu", precision="32-true", verbose=False)
    model = _model()
    model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data()[:BATCH]
    seen = []
    for _ in range(3):
        session.run_step(lambda b: F.cross_entropy(model(b[0]), b[1]), (x, y))
        seen.append(session.flops_per_step)
        session.step(opt)
    assert seen == [None, _reference_flops(), _reference_flops()] and not model._forward_pre_hooks
    assert _get_current_dispatch_mode_stack() == []  # held inside run_step only
    session.close()


def test_a_loop_without_a_gpukit_loader_or_run_step_is_not_counted() -> None:
    """Its forward is the user's code, which gpukit does not bracket: no count left open across it."""
    session = gpukit.Session(devices="cpu", precision="32-true", verbose=False)
    model = _model()
    model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data()[:BATCH]
    for _ in range(3):
        session.backward(F.cross_entropy(model(x), y))
        session.step(opt)
        assert _get_current_dispatch_mode_stack() == []
    assert session.flops_per_step is None
    session.close()


def test_the_models_own_count_is_used_as_given() -> None:
    session = gpukit.Session(devices="cpu", precision="32-true", verbose=False, flops_per_step=10**9,
                             peak_tflops=1.0)
    model = _train(session)
    assert session.flops_per_step == 10**9 and not model._forward_pre_hooks  # never counted
    assert session.mfu is not None and session.mfu.mfu == session.mfu.achieved_tflops
    session.close()


@pytest.mark.parametrize(("option", "said"), [
    ({"peak_tflops": -1}, "peak_tflops=-1"), ({"peak_tflops": "989"}, "peak_tflops='989'"),
    ({"peak_tflops": 3e14}, "TFLOP/s, not FLOP/s"), ({"flops_per_step": 0.5}, "flops_per_step=0.5"),
])
def test_bad_values_are_clear_errors(option: dict, said: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        gpukit.Session(devices="cpu", verbose=False, **option)
    assert said in str(caught.value)


def test_the_record_and_the_report_show_it(tmp_path: Path) -> None:
    session = gpukit.Session(devices="cpu", precision="32-true", verbose=False, peak_tflops=0.25,
                             record=tmp_path / "run")
    _train(session)
    flops, mfu = session.flops_per_step, session.mfu
    session.close()
    lines = [json.loads(line) for line in (tmp_path / "run" / "rank0.jsonl").read_text().splitlines()]
    events = [line for line in lines if line["type"] == "event" and line["kind"] == "mfu"]
    assert len(events) == 1
    event = events[0]
    assert event["flops_per_step"] == flops and event["flops_source"] == "counted" and event["dtype"] == "fp32"
    assert event["steps"] == 7  # 8 batches less the counted (second) one, which the counter slowed
    assert event["achieved_tflops"] == pytest.approx(flops * event["steps"] / event["seconds"] / 1e12)
    assert event["achieved_tflops"] == pytest.approx(mfu.achieved_tflops) and event["mfu"] == pytest.approx(mfu.mfu)
    record = read_record(tmp_path / "run")
    figures = summarize(record).ranks[0].flops
    assert figures is not None and figures.flops_per_step == flops and figures.peak_tflops == 0.25
    assert figures.mfu == pytest.approx(event["mfu"])
    html = render_report(record)
    assert f"{flops:,} FLOPs per step (counted)" in html and f"MFU {100 * figures.mfu:.3g}% of 0.25 TFLOP/s" in html


def _compiled_run(flops_per_step: int | None) -> tuple[int | None, dict]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    # the "eager" backend: Dynamo (where a skip or a recompilation would happen) without a C++ build
    session = gpukit.Session(devices="cpu", precision="32-true", verbose=False, compile={"backend": "eager"},
                             flops_per_step=flops_per_step)
    model = _model()
    model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data()[:BATCH]
    for _ in range(4):
        session.run_step(lambda b: F.cross_entropy(model(b[0]), b[1]), (x, y))
        session.step(opt)
    session.close()
    return session.flops_per_step, {k: dict(counters[k]) for k in ("frames", "stats")}


def test_a_compiled_model_still_compiles_once_and_is_counted() -> None:
    """Counted under the flop counter, a compiled model's first call would never compile (Dynamo skips
    the frame for good), and a hook on the model would recompile it when removed: counting the second
    step from session.step to session.step does neither, and counts the same FLOPs."""
    counted, dynamo = _compiled_run(None)
    given, plain = _compiled_run(10**6)
    assert counted == _reference_flops() and given == 10**6
    assert dynamo["stats"].get("unique_graphs", 0) >= 1, (dynamo, plain)  # it compiled
    assert dynamo == plain  # and did the same Dynamo work as a session that counts nothing


def test_batches_handed_out_without_a_step_drop_the_count_then_it_gives_up() -> None:
    session = gpukit.Session(devices="cpu", precision="32-true", verbose=False)
    model = _model()
    model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = session.setup_dataloader(_data(), batch_size=BATCH)
    batches = iter(loader)
    x, y = next(batches)  # the first step: nothing counted
    session.backward(F.cross_entropy(model(x), y))
    session.step(opt)
    for _ in range(4):  # batches looked at, never stepped on (with gradients on): each opens a count the next drops
        next(batches)
    assert session._mfu.flops_source.startswith("not counted: 3 counts dropped (the last: batches handed out")
    assert session.flops_per_step is None and _get_current_dispatch_mode_stack() == []
    session.close()


def test_an_evaluation_under_no_grad_opens_nothing_and_closing_mid_count_drops_it() -> None:
    session = gpukit.Session(devices="cpu", precision="32-true", verbose=False)
    model = _model()
    model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = session.setup_dataloader(_data(), batch_size=BATCH)
    x, y = _data()[:BATCH]
    session.backward(F.cross_entropy(model(x), y))
    session.step(opt)
    with torch.no_grad():
        for x, _ in loader:
            model(x)
            assert _get_current_dispatch_mode_stack() == []
    next(iter(loader))  # a training batch: the count opens ...
    assert len(_get_current_dispatch_mode_stack()) == 1
    session.close()  # ... and the session closes before the step
    assert _get_current_dispatch_mode_stack() == [] and session.flops_per_step is None
